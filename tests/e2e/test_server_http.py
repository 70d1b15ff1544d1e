"""The expert server's HTTP port (``--http-port``): ``/health`` sees the serving loop itself and
``/metrics`` serves this process's Prometheus text.

Bounds: a running process whose loop stops iterating answers 503 once the loop's last iteration
is older than ``--health-stale-s`` (here 2 s); a SIGSTOPped process answers nothing (the probe's
own timeout, here 3 s, fires) and answers 200 again after SIGCONT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from eaas.runtime.server.http import ServerHealth, ServerHTTP, health_verdict
from eaas.runtime.server.main import random_experts
from eaas.runtime.server.server import ExpertServer

from helpers.e2e import free_port


def wait_status(url: str, code: int, timeout: float = 60.0) -> httpx.Response:
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = httpx.get(url, timeout=5)
            if last.status_code == code:
                return last
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer {code} within {timeout} s; last: {last!r}")


def test_health_verdict_names_the_failed_check():
    kw = dict(now=100.0, stale_after_s=5.0)
    v = health_verdict(weights_loaded=False, listening=False, last_iteration=None, **kw)
    assert (v.ready, v.status) == (False, "loading")
    v = health_verdict(weights_loaded=True, listening=False, last_iteration=99.0, **kw)
    assert not v.ready and "listener" in v.reason
    v = health_verdict(weights_loaded=True, listening=True, last_iteration=None, **kw)
    assert not v.ready and "not started" in v.reason
    v = health_verdict(weights_loaded=True, listening=True, last_iteration=94.0, **kw)
    assert not v.ready and "6.0 s ago" in v.reason and v.loop_age_s == pytest.approx(6.0)
    v = health_verdict(weights_loaded=True, listening=True, last_iteration=96.0, **kw)
    assert v.ready and v.status == "ok" and v.loop_age_s == pytest.approx(4.0)
    with pytest.raises(ValueError, match="stale_after_s"):
        ServerHealth("s", stale_after_s=0)


def test_health_follows_loading_loop_and_stop_in_process():
    """Real HTTP and a real listener, in this process: loading -> not started -> ok -> stale."""
    health = ServerHealth("s-http", stale_after_s=2.0)
    http = ServerHTTP(health, 0, "127.0.0.1").start()
    url = f"http://127.0.0.1:{http.port}"
    try:
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        hosted = random_experts([(1, 0), (1, 1)], 16, 24, torch.float32, seed=3)
        server = ExpertServer(
            f"tcp://127.0.0.1:{free_port()}", hosted, 16, torch.float32, "s-http", poll_timeout=0.05
        )
        health.attach(server)
        r = httpx.get(f"{url}/health", timeout=10)
        assert r.status_code == 503 and "not started" in r.json()["reason"]
        loop = threading.Thread(target=server.serve_forever, daemon=True)
        loop.start()
        body = wait_status(f"{url}/health", 200).json()
        assert body["status"] == "ok" and body["experts"] == 2
        assert body["endpoint"] == server.endpoint
        m = httpx.get(f"{url}/metrics", timeout=10).text
        assert "eaas_expert_server_ready 1.0" in m
        assert "eaas_expert_server_loop_age_seconds" in m
        # the loop stops iterating (the process keeps running): 503 once 2 s stale
        server.stop()
        loop.join(30)
        body = wait_status(f"{url}/health", 503, timeout=30).json()
        assert "last iteration" in body["reason"]
        assert "eaas_expert_server_ready 0.0" in httpx.get(f"{url}/metrics", timeout=10).text
        assert httpx.get(f"{url}/nope", timeout=10).status_code == 404
    finally:
        http.close()


def test_expert_server_process_health_metrics_and_sigstop(model_dir, tmp_path):
    """``eaas expert-server --http-port``: 200 + metrics; SIGSTOP -> no answer; SIGCONT -> 200."""
    port = free_port()
    listen = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
        + ["--server-id", "hs0", "--experts", "1:0-3", "--listen", listen]
        + ["--http-port", str(port), "--http-host", "127.0.0.1", "--health-stale-s", "2"],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "stderr.log", "w"),
        env={k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"},
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        line = proc.stdout.readline()
        assert " ready on " in line, f"{line!r} (exit {proc.poll()})"
        assert f"http on 127.0.0.1:{port}" in (tmp_path / "stderr.log").read_text()
        body = wait_status(f"{url}/health", 200).json()
        assert body["server_id"] == "hs0" and body["experts"] == 4
        assert body["endpoint"] == listen
        m = httpx.get(f"{url}/metrics", timeout=10)
        assert m.status_code == 200 and "eaas_expert_server_ready 1.0" in m.text
        assert "eaas_expert_server_frames_total" in m.text  # this process's runtime metrics

        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{url}/health", timeout=3)
        os.kill(proc.pid, signal.SIGCONT)
        wait_status(f"{url}/health", 200, timeout=30)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
