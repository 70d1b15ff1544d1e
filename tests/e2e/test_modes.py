"""Other ways to run: the single-process baseline (``eaas attention-client --local-experts``) and
``eaas serve --transport tcp``. Both must produce the reference greedy tokens. Also: children of a
SIGKILLed ``eaas serve`` die with it (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from eaas.runtime.models.arch import read_model_info as model_info
from eaas.runtime.models.reference import reference_generate
from eaas.runtime.placement import dispatch_columns, place_experts, spread_over_cpus

from helpers.e2e import ServeProcess, alive, descendants, free_port, sigterm_and_wait

TEXTS = ["Hello world", "Kubernetes schedules pods on nodes", "def main(): print"]
MAX_TOKENS = 12


def _check_exact(base_url, tokenizer, model_dir):
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    refs = reference_generate(model_dir, prompts, MAX_TOKENS)
    for p, ref in zip(prompts, refs, strict=False):
        r = httpx.post(
            f"{base_url}/v1/completions",
            json={
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref


def test_local_experts_baseline(tokenizer, model_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "client.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eaas",
            "attention-client",
            "--local-experts",
            "--port",
            str(port),
            "--client-id",
            "7",
        ],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "attention-client 7 ready on" in line, (
            line,
            (tmp_path / "client.log").read_text()[-2000:],
        )
        base = f"http://127.0.0.1:{port}"
        h = httpx.get(f"{base}/health", timeout=10).json()
        assert h["mode"] == "local-experts" and h["client_id"] == "7"
        _check_exact(base, tokenizer, model_dir)
    finally:
        rc = sigterm_and_wait(proc, 30)
        proc.stdout.close()
        log.close()
    assert rc == 0


def test_serve_over_tcp(tokenizer, model_dir, tmp_path):
    """--transport tcp, 3 servers R=2 (exact greedy tokens); the expert servers are pinned by
    the default --server-cpus auto: one CPU each, as spread_over_cpus gives for the placement
    (every process here may use the same CPUs), the two servers of one decode call on two
    CPUs; and they run as SCHED_BATCH (default --server-sched-policy batch)."""
    sp = ServeProcess(
        ["--transport", "tcp", "--expert-servers", "3", "--replicas", "2"],
        tmp_path / "serve.log",
        free_port(),
    )
    sp.start()
    try:
        h = httpx.get(f"{sp.base_url}/health", timeout=10).json()
        assert all(s["endpoint"].startswith("tcp://127.0.0.1:") for s in h["servers"].values())
        assert len(h["servers"]) == 3
        _check_exact(sp.base_url, tokenizer, model_dir)
        assert "serving" in sp.log() and "(3 expert servers, 2 replicas, 1 client)" in sp.log()
        cpus = sorted(os.sched_getaffinity(0))
        servers = {
            int(c.split("--server-id expert-")[1].split()[0]): p
            for p, c in descendants(sp.proc.pid).items()
            if " expert-server " in c
        }
        assert sorted(servers) == [0, 1, 2], servers
        assert all(os.sched_getscheduler(p) == os.SCHED_BATCH for p in servers.values())
        if len(cpus) >= 2:
            info = model_info(model_dir)
            placement = place_experts(info.moe_layers, info.num_experts, 3, 2)
            want = spread_over_cpus(placement, cpus)
            assert [os.sched_getaffinity(servers[s]) for s in range(3)] == [{c} for c in want]
            assert f"expert servers pinned to CPUs {list(want)}" in sp.log()
            for col in dispatch_columns(placement):
                assert len({want[s] for s in col}) == min(len(col), len(cpus)), (col, want)
        else:  # one CPU: nothing to spread
            assert all(os.sched_getaffinity(p) == set(cpus) for p in servers.values())
        # serve itself is SIGKILLed (no cleanup code runs): PR_SET_PDEATHSIG takes every child down
        kids = descendants(sp.proc.pid)
        assert len(kids) == 4, kids
        sp.proc.kill()
        sp.proc.wait()
        sp.forget()
        deadline = time.monotonic() + 60
        while any(alive(p, c) for p, c in kids.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not {p: c for p, c in kids.items() if alive(p, c)}, (
            "children outlived a SIGKILLed serve"
        )
    finally:
        if not sp.stopped:
            sp.stop(check=True)
        elif sp.run_dir is not None:
            shutil.rmtree(sp.run_dir, ignore_errors=True)  # serve had no chance to remove it


def test_serve_client_that_blocks_at_once_is_exact(tokenizer, model_dir, tmp_path):
    """serve --client-spin-us 0: the attention client runs with --spin-us 0 (it never
    busy-polls for the expert servers' answers) and its greedy tokens are the reference's.
    With --server-cpus none the expert servers are not pinned (no --cpus, every CPU allowed), and
    with --server-sched-policy other they keep the default SCHED_OTHER."""
    sp = ServeProcess(
        ["--expert-servers", "2", "--replicas", "1", "--client-spin-us", "0"]
        + ["--server-cpus", "none", "--server-sched-policy", "other"],
        tmp_path / "serve.log",
        free_port(),
    )
    sp.start()
    try:
        clients = [c for c in descendants(sp.proc.pid).values() if " attention-client " in c]
        assert len(clients) == 1, clients
        argv = clients[0].split()
        assert argv[argv.index("--spin-us") + 1] == "0", argv
        servers = [p for p, c in descendants(sp.proc.pid).items() if " expert-server " in c]
        assert len(servers) == 2, servers
        for p in servers:
            assert os.sched_getaffinity(p) == os.sched_getaffinity(0), p
            assert os.sched_getscheduler(p) == os.SCHED_OTHER, p
        assert "pinned to CPUs" not in sp.log()
        assert "expert servers not pinned (--server-cpus none)" in sp.log()
        assert "(2 expert servers, 1 replica, 1 client)" in sp.log()
        assert "1 replica of each on 2 servers" in sp.log()
        _check_exact(sp.base_url, tokenizer, model_dir)
        # --replicas 1: a dead server's experts have no other replica, and the log says so (not
        # that clients fail over) and what happens: 503 for them until serve restarted it
        os.kill(sp.pid_of("--server-id expert-1"), signal.SIGKILL)
        deadline = time.monotonic() + 180
        while "has it back" not in sp.log():  # exited, restarted, ready, back in the table
            assert time.monotonic() < deadline, sp.log()[-3000:]
            time.sleep(0.2)
        log = sp.log()
        assert re.search(
            r"expert server expert-1 \(pid \d+\) exited with code -9; routing table version 2 "
            r"leaves it out; \d+ of its experts have no other replica \(--replicas 1\): "
            r"requests that need them fail with 503 until it serves again; restarting it in 1 s",
            log,
        ), log[-3000:]
        assert "fail over" not in log and "other replicas" not in log, log[-3000:]
        assert re.search(r"expert-1 \(pid \d+\) serves again: routing table version 3", log)
    finally:
        sp.stop(check=True)


def _taken_port():
    """A port held the way an attention client of another ``eaas serve`` holds it (SO_REUSEPORT)."""
    import socket

    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "TAKEN"], "--port TAKEN: cannot listen on 127.0.0.1"),
        (["--host", "999.1.1.1"], "--host 999.1.1.1: cannot listen on 999.1.1.1"),
        (["--host", "192.0.2.1"], "--host 192.0.2.1: cannot listen on 192.0.2.1"),  # not local
        (["--served-model-name", ""], "--served-model-name '': an empty model id"),
        (["--served-model-name", "a,,b"], "--served-model-name 'a,,b': an empty model id"),
        (
            ["--engine", "vllm", "--vllm", "/nonexistent/vllm"],
            "'/nonexistent/vllm': no such command",
        ),
        (["--model", "/nonexistent"], "/nonexistent/config.json"),
        (["--dtype", "float16"], "--dtype must be float32 or bfloat16"),
        (["--port", "70000"], "less than or equal to 65535"),
        (
            ["--replicas", "5", "--expert-servers", "2"],
            "--replicas (5) cannot exceed --expert-servers (2)",
        ),
        (["--replicas", "0"], "--replicas must be >= 1, got 0"),
        (["--kv-cache-memory", "lots"], "bad memory size 'lots'"),
        (["--client-device", "tpu"], "--client-device must be auto, cpu, cuda or cuda:N"),
        (["--dispatch-timeout", "0"], "--dispatch-timeout must be > 0 seconds"),
        (["--dispatch-timeout", "-1"], "--dispatch-timeout must be > 0 seconds"),
        (["--client-threads", "-3"], "'--client-threads'"),
        (["--server-threads", "-1"], "'--server-threads'"),
        (["--client-spin-us", "fast"], "--client-spin-us must be default or microseconds >= 0"),
        (["--client-spin-us", "-5"], "--client-spin-us must be default or microseconds >= 0"),
        (["--transport", "tcp", "--client-spin-us", "10"], "acts on --transport shm only"),
        (["--server-cpus", "all"], "--server-cpus must be auto or none, got 'all'"),
        (["--server-sched-policy", "fifo"], "--server-sched-policy must be batch or other"),
        # checked against the model's config before any child loads weights
        (["--kv-cache-memory", "1KiB"], "--kv-cache-memory 1024 B is below one sequence"),
    ]
    + (
        []
        if torch.cuda.is_available()
        else [(["--client-device", "cuda"], "--client-device cuda: no CUDA device is available")]
    ),
)
def test_serve_rejects_bad_options_before_starting_anything(args, message):
    """Bad options: exit code 2, one clear message naming the problem, no traceback, no child
    started -- in particular a port taken by another deployment (whose clients bind with
    SO_REUSEPORT) is refused instead of silently shared."""
    held = _taken_port()
    try:
        taken = str(held.getsockname()[1])
        args = [taken if a == "TAKEN" else a for a in args]
        message = message.replace("TAKEN", taken)
        if "--port" not in args:  # not the default 8000, which a user's serve may hold
            args += ["--port", str(free_port())]
        r = subprocess.run(
            [sys.executable, "-m", "eaas", "serve", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        held.close()
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert message in " ".join(out.split()), out
    assert "Traceback" not in out, out
    assert "expert-server" not in r.stdout, out  # nothing was spawned


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_attention_client_rejects_a_dispatch_timeout_not_above_zero(value):
    r = subprocess.run(
        [sys.executable, "-m", "eaas", "attention-client", "--local-experts"]
        + ["--port", str(free_port()), "--dispatch-timeout", value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "--dispatch-timeout must be > 0 seconds" in " ".join(out.split()), out
    assert "ready on" not in out, out


def test_parse_client_spin():
    """serve's --client-spin-us: "default" (or None) leaves the transport's busy-poll, a number
    of microseconds >= 0 is passed on (0: block at once), anything else is an error naming it."""
    from eaas.runtime.options.serve import parse_client_spin

    assert parse_client_spin("default") is None
    assert parse_client_spin(" DEFAULT ") is None
    assert parse_client_spin(None) is None
    assert parse_client_spin("0") == 0.0
    assert parse_client_spin(150) == 150.0
    for bad in ("x", "-1", "nan", "inf", "auto"):
        with pytest.raises(ValueError, match="--client-spin-us"):
            parse_client_spin(bad)
