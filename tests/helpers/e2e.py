"""Helpers for end-to-end tests: real ``eaas serve`` / ``eaas expert-server`` processes on loopback."""

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

from helpers.common import free_port  # noqa: F401  (the e2e tests take it from here)


def descendants(pid: int) -> dict[int, str]:
    """``{pid: cmdline}`` of every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = cmdline(c)
            todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def alive(pid: int, cmd: str | None = None) -> bool:
    """Process ``pid`` still exists (not a zombie), with the command line ``cmd`` where given
    (a pid reused by another process then does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (cmd is None or cmdline(pid) == cmd)


def sigterm_and_wait(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM ``proc`` and wait for it; SIGKILL it after ``timeout`` s. Returns its exit code
    (negative: the signal that ended it)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def shm_files() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("eaas")}
    except FileNotFoundError:
        return set()


class ServeProcess:
    """``python -m eaas serve`` (or ``command``, e.g. the ``eaas`` console script, then
    ``serve``) as a subprocess in ``cwd`` (default: this one); output goes to ``log_path``."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        port: int,
        *,
        command: list[str] | None = None,
        cwd: Path | None = None,
    ):
        self.args = args
        self.command = command or [sys.executable, "-m", "eaas"]
        self.cwd = cwd
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.run_dir: Path | None = None
        self.children: dict[int, str] = {}
        self.stopped = False

    def start(self, timeout: float = 240.0) -> None:
        env = dict(os.environ)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [*self.command, "serve", "--port", str(self.port), *self.args],
            cwd=self.cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
        deadline = time.monotonic() + timeout
        while True:
            text = self.log()
            if re.search(r"\[eaas serve\] serving \S+ on http://", text):
                break
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"eaas serve exited with {self.proc.returncode}:\n{text[-4000:]}"
                )
            if time.monotonic() > deadline:
                self.stop(check=False)
                raise RuntimeError(f"eaas serve not ready after {timeout} s:\n{text[-4000:]}")
            time.sleep(0.25)
        m = re.search(r"routing table version 1: (\S+)/routing-table\.json", text)
        assert m, text[-2000:]
        self.run_dir = Path(m.group(1))
        self.children = descendants(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid_of(self, fragment: str) -> int:
        """Pid of the child whose command line contains ``fragment`` (e.g. '--server-id expert-1')."""
        for pid, cmd in descendants(self.proc.pid).items():
            if fragment in cmd:
                return pid
        raise LookupError(f"no child with {fragment!r}")

    def forget(self) -> None:
        """After serve was killed outside :meth:`stop`: close the log, mark it stopped."""
        self.stopped = True
        self._log.close()

    def stop(self, check: bool = True) -> None:
        """SIGTERM serve; with ``check``, assert a clean exit, no orphans, no leftovers."""
        if self.stopped or self.proc is None:
            return
        self.stopped = True
        kids = descendants(self.proc.pid)
        kids.update({p: c for p, c in self.children.items() if p not in kids})
        shm_before = shm_files()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
            for p in kids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            if check:
                raise AssertionError("eaas serve did not exit within 60 s of SIGTERM") from None
        self._log.close()
        if not check:
            return
        assert rc == 0, f"eaas serve exit code {rc}:\n{self.log()[-3000:]}"
        deadline = time.monotonic() + 30  # serve reaped them; wait out the kernel's bookkeeping
        while any(alive(p, c) for p, c in kids.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: c for p, c in kids.items() if alive(p, c)}
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"orphaned children after SIGTERM: {left}"
        assert self.run_dir is not None and not self.run_dir.exists(), (
            f"run dir {self.run_dir} left behind"
        )
        assert not (shm_files() - shm_before), f"leaked /dev/shm files: {shm_files() - shm_before}"
        assert not {f for f in shm_files() if f.startswith("eaas")}, (
            "eaas shared memory in /dev/shm"
        )


def start_serve(tmp_path_factory, name: str, args: list[str]) -> ServeProcess:
    log = tmp_path_factory.mktemp(name) / "serve.log"
    sp = ServeProcess(args, log, free_port())
    sp.start()
    return sp


#: the prompts and length of the failover tests (tests/e2e/test_fault.py, test_hung_server.py)
FAILOVER_TEXTS = [
    "The expert server hosts a set of experts and",
    "Kubernetes schedules pods on nodes",
    "A routing table maps every logical expert",
    "Hello world",
]
FAILOVER_MAX_TOKENS = 40


def stream_completion(base_url, model_name, prompt_ids, out: dict, started: threading.Event):
    """Stream one greedy ``/v1/completions`` of ``prompt_ids`` (:data:`FAILOVER_MAX_TOKENS`
    tokens) into ``out``: ``status``, ``ids`` (token ids), ``times`` (``time.monotonic()`` of each
    chunk), ``finish`` (finish reason), ``error`` (an error event) or ``exception``; sets
    ``started`` once two tokens arrived. For a thread's target."""
    ids, times = [], []
    try:
        with httpx.stream(
            "POST",
            f"{base_url}/v1/completions",
            json={
                "model": model_name,
                "prompt": prompt_ids,
                "max_tokens": FAILOVER_MAX_TOKENS,
                "temperature": 0,
                "stream": True,
                "return_token_ids": True,
            },
            timeout=120,
        ) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    out["error"] = payload["error"]
                    continue
                ch = payload["choices"][0]
                ids.extend(ch["token_ids"])
                times.append(time.monotonic())
                if len(ids) >= 2:
                    started.set()
                if ch["finish_reason"]:
                    out["finish"] = ch["finish_reason"]
    except Exception as exc:  # noqa: BLE001
        out["exception"] = repr(exc)
    out["ids"], out["times"] = ids, times


def serve_fixture(name: str, args: list[str]):
    """A module-scoped fixture: one ``eaas serve ARGS`` (:func:`start_serve`, logs under a temp
    directory named ``name``) shared by a module's tests, stopped after its last test with
    ``stop(check=True)`` (a no-op when a test already stopped it). Use as
    ``deployment = serve_fixture("serve-api", ["--expert-servers", "4"])``."""

    @pytest.fixture(scope="module")
    def deployment(tmp_path_factory):
        sp = start_serve(tmp_path_factory, name, args)
        yield sp
        sp.stop(check=True)

    return deployment


def served_model_name(base_url: str) -> str:
    """The model id the server at ``base_url`` serves (the first of ``GET /v1/models``)."""
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def metric_values(base_url: str) -> dict[tuple[str, tuple], float]:
    """Samples of GET /metrics as ``{(name, sorted label items): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{base_url}/metrics", timeout=10)
    r.raise_for_status()
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(values: dict, name: str, **labels) -> float:
    return sum(
        v
        for (n, lab), v in values.items()
        if n == name and all(dict(lab).get(k) == str(x) for k, x in labels.items())
    )


def greedy_token_ids(api, model: str, prompt, max_tokens: int) -> list[int]:
    """The token ids of one greedy completion through the official ``openai`` client ``api``
    (``return_token_ids``: the server sends ``token_ids`` only when asked, as vLLM)."""
    out = api.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    return out.choices[0].model_extra["token_ids"]
