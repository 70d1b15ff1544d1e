"""Helpers for transport / expert-server tests: real server processes with random weights.

Servers run in forked processes (fast: no second torch import), each with its own sockets and
``torch.set_num_threads(1)`` set first thing (forked children must not use the parent's OpenMP
pool). ``start_server`` waits for the listener to accept before returning.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
from dataclasses import dataclass

import torch

from eaas.runtime.expert_server import ExpertServer, random_experts
from eaas.runtime.experts import weighted_expert_sum
from eaas.runtime.placement import parse_expert_spec

from helpers.polling import wait_until  # noqa: F401  (the servers' tests wait with it)

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


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


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
