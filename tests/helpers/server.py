"""Helpers for transport / expert-server tests: real server processes with random weights.

Servers run in forked processes (fast: no second torch import), each with its own sockets and
``torch.set_num_threads(1)`` set first thing (forked children must not use the parent's OpenMP
pool). ``start_server`` waits for the listener to accept before returning.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass

import pytest
import torch

from eaas.runtime.experts import weighted_expert_sum
from eaas.runtime.server.main import random_experts
from eaas.runtime.server.server import ExpertServer
from eaas.runtime.tables.expert_spec import parse_expert_spec
from eaas.runtime.transport.base import STATUS_OK, FrameError, RequestFrame
from eaas.runtime.transport.factory import connect as factory_connect

from helpers.common import free_port, wait_until  # noqa: F401  (the servers' tests use them)

HIDDEN = 32
INTER = 48
SEED = 7
SPEC = "1:0-3;2:0-1"


def _serve(endpoint, spec, hidden, inter, seed, dtype, metrics_port, window_us, pipe, listener_kw):
    # First thing in a forked child: the parent's OpenMP pool does not survive fork; one thread
    # keeps torch from entering a parallel region (which can hang after fork).
    torch.set_num_threads(1)
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr="127.0.0.1")
    hosted = random_experts(parse_expert_spec(spec), hidden, inter, dtype, seed)
    server = ExpertServer(
        endpoint,
        hosted,
        hidden,
        dtype,
        "s-test",
        batch_window_us=window_us,
        poll_timeout=0.05,
        **listener_kw,
    )
    server.install_signal_handlers()
    pipe.send(("ready", server.endpoint))
    server.serve_forever()
    pipe.send(("stats", dict(server.stats)))
    pipe.close()


@dataclass
class ServerProc:
    proc: mp.Process
    endpoint: str
    pipe: object

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 5.0) -> dict | None:
        """SIGTERM, wait, return the server's stats (None if it died without reporting)."""
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        stats = None
        if self.pipe.poll(timeout):
            try:
                msg = self.pipe.recv()
                stats = msg[1] if msg[0] == "stats" else None
            except EOFError:
                pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2)
        return stats

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)


def start_server(
    endpoint: str,
    spec: str = SPEC,
    dtype=torch.float32,
    metrics_port: int = 0,
    window_us: float = 0.0,
    hidden: int = HIDDEN,
    inter: int = INTER,
    **listener_kw,
) -> ServerProc:
    """Fork an expert server on ``endpoint``; ``listener_kw`` go to the transport listener
    (e.g. ``send_timeout`` for tcp). Waits until it accepts connections."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(
        target=_serve,
        args=(
            endpoint,
            spec,
            hidden,
            inter,
            SEED,
            dtype,
            metrics_port,
            window_us,
            child,
            listener_kw,
        ),
        daemon=True,
    )
    p.start()
    child.close()
    if not parent.poll(20):
        p.kill()
        raise RuntimeError("server did not become ready")
    kind, ep = parent.recv()
    assert kind == "ready"
    return ServerProc(p, ep, parent)


def reference(
    layer: int,
    hidden: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    spec: str = SPEC,
    dtype=torch.float32,
) -> torch.Tensor:
    """What the server must answer, computed locally with the same random weights."""
    pairs = [p for p in parse_expert_spec(spec) if p[0] == layer]
    w = random_experts(pairs, hidden.shape[1], INTER, dtype, SEED)
    return weighted_expert_sum(hidden, experts, weights, {e: w[(l, e)] for l, e in pairs})


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc/<pid>/stat, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def request_frame(n, k, layer=1, n_exp=4, dtype=torch.float32, seq=0, gen=None) -> RequestFrame:
    """A :class:`RequestFrame` of client 1, table version 3: ``n`` tokens of :data:`HIDDEN`
    random hidden values in ``dtype``, each with ``k`` distinct experts out of ``n_exp`` (int32;
    token 0's last entry ``-1``, a padding entry, when ``k > 1``) and random float32 weights;
    seeded by ``n`` and ``k`` unless ``gen`` (a ``torch.Generator``) is given."""
    g = gen or torch.Generator().manual_seed(1000 + n * 31 + k)
    h = torch.randn(n, HIDDEN, generator=g).to(dtype)
    ex = (
        torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(n)]).to(torch.int32)
        if n
        else torch.zeros(0, k, dtype=torch.int32)
    )
    if n and k > 1:
        ex[0, -1] = -1  # one padding entry
    w = torch.rand(n, k, generator=g)
    return RequestFrame(
        client_id=1, layer=layer, table_version=3, seq=seq, hidden=h, experts=ex, weights=w
    )


#: the transports of the transport tests; cudaipc with payload="host" (no GPU needed;
#: tests/gpu/test_cuda_ipc.py adds the CUDA payload on a GPU machine)
TRANSPORT_KINDS = ["unix", pytest.param("cudaipc", marks=pytest.mark.gpu_cpu), "tcp"]


def connect_emulated(endpoint: str, server_id: str, **kw):
    """The factory's ``connect``; a ``cudaipc:`` endpoint uses its host emulation."""
    if endpoint.startswith("cudaipc:"):
        kw.setdefault("payload", "host")
    return factory_connect(endpoint, server_id, **kw)


def listen_endpoint(kind: str, tmp_path) -> str:
    """A listen endpoint of transport ``kind`` (a socket under ``tmp_path``, or TCP port 0)."""
    if kind in ("unix", "cudaipc"):
        return f"{kind}:{tmp_path}/es.sock"
    return "tcp://127.0.0.1:0"


def assert_misuse_raises_frame_error(c, reply_timeout_s: float) -> None:
    """On a fresh float32 connection ``c``: a bfloat16 frame, a ``recv`` with nothing sent, and a
    second ``send`` while one is in flight each raise ``FrameError``; the frame in flight is still
    answered ``STATUS_OK`` within ``reply_timeout_s`` seconds."""
    with pytest.raises(FrameError, match="dtype"):
        c.send(request_frame(2, 1, dtype=torch.bfloat16))
    with pytest.raises(FrameError, match="recv without"):
        c.recv(time.monotonic() + 1)
    c.send(request_frame(2, 1))
    with pytest.raises(FrameError, match="in flight"):
        c.send(request_frame(2, 1))
    assert c.recv(time.monotonic() + reply_timeout_s).status == STATUS_OK
