"""``eaas serve``'s life cycle and start-up checks: a terminal's Ctrl-C during a long request
(clients stop before servers), a second Ctrl-C, stale and SIGKILLed run directories; the API
answering while a huge prompt is tokenized and a too-large body refused; bad numbers, a bad KV-cache size or device
refused before the children load the model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.e2e import ServeProcess, alive, free_port, sigterm_and_wait


def test_ctrl_c_ends_clients_before_servers_and_requests_see_no_dead_replica(tmp_path):
    """A terminal's Ctrl-C (SIGINT to serve's whole process group; SIGTERM to serve takes the
    same path from serve on) while a long stream runs: the clients stop first (while every
    expert server still answers), so the stream ends normally or with 503
    ``server_shutting_down``, never with ``no_live_replica``; the log shows every client stopped
    before any server. (Each child leads a group of its own, so the terminal's SIGINT reaches
    serve alone.)"""
    sp = ServeProcess(
        ["--expert-servers", "2", "--replicas", "1"], tmp_path / "serve.log", free_port()
    )
    sp.start()
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    lines: list[str] = []
    try:
        model = httpx.get(f"{sp.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        body["model"] = model
        with httpx.stream("POST", f"{sp.base_url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            it = r.iter_lines()
            for line in it:  # the first token has arrived: the request is running
                if line.startswith("data: {"):
                    lines.append(line)
                    break
            os.killpg(sp.proc.pid, signal.SIGINT)  # a terminal signals its foreground group
            for line in it:
                lines.append(line)
    finally:
        sp.stop(check=True)  # SIGTERM again is harmless; asserts a clean exit, no leftovers
    lines = [line for line in lines if line]  # SSE events are separated by empty lines
    text = "\n".join(lines)
    assert "no_live_replica" not in text, text[-2000:]
    assert lines[-1] == "data: [DONE]", text[-2000:]
    last = json.loads(lines[-2][len("data: ") :])
    if "error" in last:  # ended by the shutdown rather than finished within the grace period
        assert last["error"]["code"] == "server_shutting_down", last
    else:
        assert last["choices"][0]["finish_reason"] == "length", last
    log = sp.log()
    client_stop = [m.start() for m in re.finditer(r"attention-client \d+ stopped$", log, re.M)]
    server_stop = [m.start() for m in re.finditer(r"expert-server \S+ stopped$", log, re.M)]
    assert client_stop and len(server_stop) == 2, log[-3000:]
    assert max(client_stop) < min(server_stop), log[-3000:]


# the client's --max-request-body: above the big prompt (2 MB), below the too-large body
BODY_LIMIT_MIB = 3


@pytest.fixture(scope="module")
def local_client(tmp_path_factory):
    """One ``attention-client --local-experts`` (a whole API in one process) with a small body
    limit, so a too-large body is cheap to send."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("local") / "client.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eaas",
            "attention-client",
            "--local-experts",
            "--port",
            str(port),
            "--max-request-body",
            f"{BODY_LIMIT_MIB}MiB",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "ready on" in line, (line, log_path.read_text()[-2000:])
        yield f"http://127.0.0.1:{port}"
    finally:
        rc = sigterm_and_wait(proc, 60)
        proc.stdout.close()
        log.close()
    assert rc == 0


def test_health_answers_while_a_huge_prompt_is_tokenized(local_client):
    """A 2 MB prompt (1M tokens, ~500x the 2048-token context) takes seconds to tokenize (about 5 s per
    million tokens here); meanwhile ``/health`` still answers (the tokenizer runs in a worker
    thread, not on the event loop). ``/tokenize`` tokenizes it whole; a completion refuses it
    before tokenizing (more characters than any prompt of 2048 tokens)."""
    done = threading.Event()
    result: dict = {}

    def big() -> None:
        try:
            r = httpx.post(
                f"{local_client}/tokenize", json={"prompt": "a " * 1_000_000}, timeout=600
            )
            result["status"] = r.status_code
            result["body"] = r.json()
        finally:
            done.set()

    t = threading.Thread(target=big, daemon=True)
    t.start()
    # /health, asked again and again while the big request is unanswered: with the tokenizer on
    # the event loop, no answer comes until the big request is done (at most one slips through
    # at the moment it ends); off the loop, answers keep coming
    answered = 0
    deadline = time.monotonic() + 300
    while not done.is_set() and time.monotonic() < deadline:
        h = httpx.get(f"{local_client}/health", timeout=120)
        if not done.is_set():
            assert h.status_code == 200, h.text
            answered += 1
    t.join(600)
    print(f"[measure] /health answered {answered} times while the big prompt was tokenized")
    assert answered >= 5, (
        f"/health answered only {answered} times while the big prompt was tokenized"
    )
    assert result["status"] == 200 and result["body"]["count"] >= 1_000_000, result["status"]
    # as a completion it is longer than the model's context: a clear 400, the server keeps serving
    r = httpx.post(
        f"{local_client}/v1/completions",
        json={"prompt": "a " * 1_000_000, "max_tokens": 1},
        timeout=600,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(f"{local_client}/health", timeout=60).status_code == 200


def test_too_large_body_gets_413_in_openai_shape(local_client):
    r = httpx.post(
        f"{local_client}/v1/completions",
        content=b'{"prompt": "' + b"a" * ((BODY_LIMIT_MIB + 1) * 2**20) + b'"}',
        headers={"content-type": "application/json"},
        timeout=300,
    )
    assert r.status_code == 413, r.text[:500]
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "--max-request-body" in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert httpx.get(f"{local_client}/health", timeout=60).status_code == 200


def test_second_ctrl_c_says_it_kills_now(tmp_path):
    """Ctrl-C starts the graceful stop; a second Ctrl-C prints one line saying it kills the
    processes now, and they are gone (one expert server and one client: the fewest processes
    that show both roles)."""
    sp = ServeProcess(
        ["--expert-servers", "1", "--replicas", "1"], tmp_path / "serve.log", free_port()
    )
    sp.start()
    kids = dict(sp.children)
    try:
        sp.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while "[eaas serve] stopping" not in sp.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "[eaas serve] stopping" in sp.log(), sp.log()[-2000:]
        sp.proc.send_signal(signal.SIGINT)
        sp.proc.wait(120)
    finally:
        if sp.proc.poll() is None:
            sp.stop(check=False)
        else:
            sp.forget()
    assert "second Ctrl-C: killing all processes now" in sp.log(), sp.log()[-2000:]
    deadline = time.monotonic() + 60
    while any(alive(p, c) for p, c in kids.items()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {p: c for p, c in kids.items() if alive(p, c)}


def test_expert_server_help_names_the_threads_default_once():
    r = subprocess.run(
        [sys.executable, "-m", "eaas", "expert-server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    i = next(i for i, x in enumerate(lines) if "--threads" in x)
    entry = " ".join(lines[i : i + 2])  # the help text, then typer's "[default: ...]" line
    assert "(default 1)" not in entry and entry.count("default: 1") == 1, entry


def _serve_in(tmp: Path, log_path: Path) -> subprocess.Popen:
    """``eaas serve`` (1 expert server) whose temp dir, and so run dir, is under ``tmp``."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    argv = ["serve", "--port", str(free_port()), "--expert-servers", "1", "--replicas", "1"]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "eaas", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )


def _wait_for_run_dir(tmp: Path, proc: subprocess.Popen, log_path: Path, known=()) -> Path:
    """The new run dir under ``tmp`` once serve wrote its owner file (start-up under way)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        new = [d for d in tmp.glob("eaas-serve-*") if d not in known and (d / "owner").exists()]
        if new:
            return new[0]
        assert proc.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no run dir after 240 s:\n{log_path.read_text()[-3000:]}")


def test_stale_run_dirs_are_those_whose_owner_is_gone(tmp_path):
    """Only run dirs whose owner file names a process that is gone are stale: a dead pid or a
    pid reused by another process (other start time); a live owner, a dir without an owner
    file (a serve that just created it) and other names are kept."""
    from eaas.runtime.serve import proc_start_ticks, remove_stale_run_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = os.getpid()
    ticks = proc_start_ticks(me)
    assert ticks is not None
    owners = {
        "eaas-serve-dead": f"{gone.pid} 1\n",
        "eaas-serve-reused": f"{me} {ticks + 1}\n",
        "eaas-serve-live": f"{me} {ticks}\n",
        "eaas-serve-live-old-format": f"{me}\n",
        "eaas-serve-garbage": "not a pid\n",
        "other-dead": f"{gone.pid} 1\n",
    }
    for name, text in owners.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "owner").write_text(text)
    (tmp_path / "eaas-serve-no-owner").mkdir()
    removed = remove_stale_run_dirs(tmp_path)
    assert sorted(d.name for d in removed) == ["eaas-serve-dead", "eaas-serve-reused"]
    assert sorted(d.name for d in tmp_path.iterdir()) == [
        "eaas-serve-garbage",
        "eaas-serve-live",
        "eaas-serve-live-old-format",
        "eaas-serve-no-owner",
        "other-dead",
    ]


def test_sigkilled_serve_leaves_a_run_dir_the_next_start_removes_and_sigterm_in_start_up(tmp_path):
    """A SIGKILLed serve cannot remove its run dir; the next serve removes it at start (and
    keeps a live serve's). SIGTERM during that serve's start-up is reported as an interruption
    by SIGTERM (not as a failed start-up), stops what started, removes its run dir and exits
    143 (128 + SIGTERM)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    live = tmp / "eaas-serve-live"  # a serve still running (this test process stands in)
    live.mkdir()
    (live / "owner").write_text(f"{os.getpid()}\n")
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = _serve_in(tmp, first_log)
    try:
        stale = _wait_for_run_dir(tmp, first, first_log, known=[live])
    finally:
        first.kill()
        first.wait(60)
    assert stale.exists()  # SIGKILL: no cleanup ran
    second = _serve_in(tmp, second_log)
    try:
        run_dir = _wait_for_run_dir(tmp, second, second_log, known=[live, stale])
        second.send_signal(signal.SIGTERM)
        rc = second.wait(120)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(60)
    log = second_log.read_text()
    assert rc == 128 + signal.SIGTERM, log[-3000:]
    assert not re.search(r"\[eaas serve\] serving \S+ on http://", log), log[
        -3000:
    ]  # start-up it was
    assert "interrupted by SIGTERM during start-up" in log, log[-3000:]
    assert "start-up failed" not in log and "Traceback" not in log, log[-3000:]
    assert f"removed 1 run directory of serve processes that are gone: {stale}" in log, log
    assert not stale.exists() and not run_dir.exists() and live.exists()
