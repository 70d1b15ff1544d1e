"""cudaipc transport: the shm slot-and-flag protocol tests, run on

* ``unix`` (the shm transport, the reference behaviour),
* ``cudaipc-host`` (the cudaipc code path with its payload in host memory: CPU, ``gpu_cpu``),
* ``cudaipc-cuda`` (payload in CUDA IPC memory, server computing on the GPU: ``gpu``),

each against a real expert-server process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eaas.runtime.transport.base import (
    STATUS_NOT_HOSTED,
    STATUS_OK,
    DeadlineExceeded,
    FrameError,
    PeerDeadError,
)
from eaas.runtime.transport.factory import connect

from helpers.server import (
    HIDDEN,
    INTER,
    SEED,
    SPEC,
    assert_misuse_raises_frame_error,
    reference,
    request_frame,
    start_server,
)

pytestmark = pytest.mark.timeout(120)

KINDS = [
    pytest.param("unix", marks=pytest.mark.gpu_cpu),
    pytest.param("cudaipc-host", marks=pytest.mark.gpu_cpu),
    pytest.param("cudaipc-cuda", marks=pytest.mark.gpu),
]


class _SubprocServer:
    """``python -m eaas.runtime.server.main --device cuda`` (fresh CUDA context, no fork)."""

    def __init__(self, endpoint: str, dtype: torch.dtype):
        dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eaas.runtime.server.main", "--listen", endpoint,
             "--experts", SPEC, "--random", f"{HIDDEN}:{INTER}:{SEED}", "--dtype", dt,
             "--device", "cuda"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        assert "ready on" in line, line
        self.endpoint, self.pid = endpoint, self.proc.pid

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.proc.terminate()
        self.proc.wait(20)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(20)


def _server(kind, tmp_path, dtype=torch.float32):
    if kind == "unix":
        return start_server(f"unix:{tmp_path}/es.sock", dtype=dtype)
    if kind == "cudaipc-host":
        return start_server(f"cudaipc:{tmp_path}/es.sock", dtype=dtype)
    return _SubprocServer(f"cudaipc:{tmp_path}/es.sock", dtype)


def _connect(kind, srv, dtype=torch.float32, **kw):
    if kind.startswith("cudaipc"):
        kw["payload"] = kind.split("-")[1]
    return connect(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=dtype, **kw)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_round_trip_matches_reference_and_grows(kind, dtype, tmp_path):
    srv = _server(kind, tmp_path, dtype)
    try:
        c = _connect(kind, srv, dtype, max_tokens=4, max_k=1)  # later frames force a remap
        cases = [
            (1, 1, 1, 4),
            (3, 2, 1, 4),
            (17, 4, 1, 4),
            (5, 2, 2, 2),
            (0, 2, 1, 4),
            (64, 3, 1, 4),
        ]
        for i, (n, k, layer, n_exp) in enumerate(cases):
            f = request_frame(n, k, layer, n_exp, dtype, seq=100 + i)
            c.send(f)
            r = c.recv(time.monotonic() + 30)
            assert r.status == STATUS_OK, r.message
            assert (r.seq, r.layer) == (100 + i, layer)
            assert r.output.dtype == dtype and tuple(r.output.shape) == (n, HIDDEN)
            assert r.output.is_cuda == (kind == "cudaipc-cuda")
            ref = reference(layer, f.hidden, f.experts, f.weights, dtype=dtype)
            tol = (
                dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
            )
            torch.testing.assert_close(r.output.cpu().float(), ref.float(), **tol)
        # an expert this server does not host: an error response, the connection keeps working
        bad = request_frame(2, 1, layer=2, n_exp=4, dtype=dtype)
        bad.experts[:] = 3
        c.send(bad)
        r = c.recv(time.monotonic() + 30)
        assert r.status == STATUS_NOT_HOSTED and "does not host layer 2" in r.message
        c.send(request_frame(2, 1, dtype=dtype, seq=7))
        assert c.recv(time.monotonic() + 30).seq == 7
        c.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_protocol_misuse_raises_frame_error(kind, tmp_path):
    srv = _server(kind, tmp_path)
    try:
        with pytest.raises(FrameError, match="hidden size"):
            connect(
                srv.endpoint,
                "s",
                hidden_size=HIDDEN + 1,
                dtype=torch.float32,
                **({"payload": kind.split("-")[1]} if "-" in kind else {}),
            )
        c = _connect(kind, srv)
        assert_misuse_raises_frame_error(c, 30)
        c.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_server_sigkill_mid_request_gives_peer_dead(kind, tmp_path):
    srv = _server(kind, tmp_path)
    c = _connect(kind, srv)
    c.send(request_frame(2, 1))
    assert c.recv(time.monotonic() + 30).status == STATUS_OK
    os.kill(srv.pid, signal.SIGSTOP)  # the next request is surely in flight when it dies
    c.send(request_frame(3, 1))
    os.kill(srv.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PeerDeadError):
        c.recv(time.monotonic() + 30)
    assert time.monotonic() - t0 < 5.0  # EOF on the socket, far before the deadline
    c.close()
    srv.kill()


@pytest.mark.parametrize("kind", KINDS)
def test_stopped_server_hits_deadline_then_recovers(kind, tmp_path):
    srv = _server(kind, tmp_path)
    try:
        c = _connect(kind, srv)
        c.send(request_frame(1, 1))  # warm (CUDA module load on the server)
        assert c.recv(time.monotonic() + 60).status == STATUS_OK
        os.kill(srv.pid, signal.SIGSTOP)
        f = request_frame(4, 2)
        c.send(f)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.recv(t0 + 1.5)
        assert 1.4 < time.monotonic() - t0 < 10
        os.kill(srv.pid, signal.SIGCONT)
        r = c.recv(time.monotonic() + 30)  # the late answer is still delivered
        assert r.status == STATUS_OK
        ref = reference(1, f.hidden, f.experts, f.weights)
        torch.testing.assert_close(r.output.cpu(), ref, rtol=1e-4, atol=1e-5)
        c.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_client_gone_does_not_disturb_server(kind, tmp_path):
    srv = _server(kind, tmp_path)
    try:
        for _ in range(2):  # clients vanish with a request in flight
            c = _connect(kind, srv)
            c.send(request_frame(8, 2))
            c.close()
        c = _connect(kind, srv)
        for i in range(5):
            c.send(request_frame(3, 2, seq=i))
            r = c.recv(time.monotonic() + 30)
            assert r.status == STATUS_OK and r.seq == i
        c.close()
    finally:
        srv.stop()


@pytest.mark.gpu_cpu
def test_cuda_payload_without_gpu_is_a_clear_error(tmp_path, monkeypatch):
    from eaas.runtime.cuda import GpuUnavailableError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GpuUnavailableError, match="payload='host'"):
        connect(f"cudaipc:{tmp_path}/x.sock", "s", hidden_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="'cuda' or 'host'"):
        connect(f"cudaipc:{tmp_path}/x.sock", "s", hidden_size=8, dtype=torch.float32, payload="x")


@pytest.mark.gpu_cpu
def test_connect_to_nothing_is_peer_dead(tmp_path):
    with pytest.raises(PeerDeadError):
        connect(
            f"cudaipc:{tmp_path}/none.sock", "s", hidden_size=8, dtype=torch.float32, payload="host"
        )
