"""The floor of :mod:`transport_bench`: a minimal shared-memory round trip between two processes
(the server a fork of the client), with what a frame holds and shm's wait policy, and nothing
else (no validation, no frame objects, no liveness checks). :class:`ProtoClient` is the client;
the bench's ``proto`` kind (see transport_bench.py's docstring for the full description).
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import threading
import time

import torch

_MAX_SPIN_S = 2e-3  # as the shm client: never spin longer than this for one response


class ProtoBuffer:
    """One MAP_SHARED buffer holding what a frame holds: ``flags int64[16]``, two cache lines
    laid out as shm's headers (request: [0] counter, [1..6] layer, table version, n, k,
    client id, seq, [7] server waiting; response: [8] counter, [9..13] layer, status, n,
    message length, seq, [15] client waiting), the request ``hidden [n, H]``, ``experts
    [n, k]`` int32 and ``weights [n, k]`` float32, and the response ``[n, H]``; plus a
    ``SOCK_SEQPACKET`` socket pair as the doorbell."""

    def __init__(self, n: int, hidden: int, k: int, dtype: torch.dtype):
        esz = torch.empty((), dtype=dtype).element_size()
        body = n * hidden * esz
        self.mm = mmap.mmap(-1, 128 + 2 * body + 2 * n * k * 4)  # anonymous, shared with a fork
        self.flags = memoryview(self.mm)[:128].cast("q")
        self.req_hdr = self.flags[:8]  # the request header line (read with one tolist)
        self.resp_hdr = self.flags[8:]
        self.req = torch.frombuffer(self.mm, dtype=dtype, count=n * hidden, offset=128).view(
            n, hidden
        )
        off = 128 + body
        self.experts = torch.frombuffer(self.mm, dtype=torch.int32, count=n * k, offset=off)
        self.experts = self.experts.view(n, k)
        off += n * k * 4
        self.weights = torch.frombuffer(self.mm, dtype=torch.float32, count=n * k, offset=off)
        self.weights = self.weights.view(n, k)
        off += n * k * 4
        self.resp = torch.frombuffer(self.mm, dtype=dtype, count=n * hidden, offset=off).view(
            n, hidden
        )
        self.client_sock, self.server_sock = socket.socketpair(
            socket.AF_UNIX, socket.SOCK_SEQPACKET
        )


_LOCK = threading.Lock()
_acquire, _release = _LOCK.acquire, _LOCK.release  # the store-load fence (a locked op on x86)
pack_request = struct.Struct("<6q").pack_into  # request header fields [1..6], as shm
pack_response = struct.Struct("<5q").pack_into  # response header fields [9..13], as shm
_REQ_WAITING, _RESP_WAITING = 7, 15  # the waiting flags' slots in ``flags``


def _proto_block(flags, idx: int, old: int, waiting_idx: int, sock: socket.socket) -> None:
    """Set our waiting flag (``flags[waiting_idx]``), then block on the doorbell until
    ``flags[idx]`` is no longer ``old`` (Dekker-style, as shm: flag, fence, re-check, sleep)."""
    flags[waiting_idx] = 1
    try:
        while True:
            _acquire()
            _release()
            if flags[idx] != old:
                return
            select.select([sock], [], [])
            sock.recv(64)
    finally:
        flags[waiting_idx] = 0


def _proto_server(p: ProtoBuffer, spin_s: float) -> None:
    """Child: the shm listener's policy (spin ``spin_s`` on the request counter, longer while
    frames come within a spin (:func:`~eaas.runtime.transport.shm._server_spin_s`), then block
    on the doorbell), read the request header, echo the hidden rows, write the response header
    and counter, ring the client's doorbell only if it waits; a counter of -1 stops."""
    from eaas.runtime.transport.shm_server import _server_spin_s

    torch.set_num_threads(1)
    flags, seen, sock = p.flags, 0, p.server_sock
    req_hdr, resp, req = p.req_hdr, p.resp, p.req
    sock.setblocking(True)
    mono, yld = time.monotonic, os.sched_yield
    gap = 0.0  # moving average of the waits for a frame (shm's adaptive server spin)
    while True:
        if flags[0] == seen:
            start = mono()
            end = start + _server_spin_s(spin_s, gap)
            while flags[0] == seen and mono() < end:
                yld()
            if flags[0] == seen:
                _proto_block(flags, 0, seen, _REQ_WAITING, sock)
            gap = 0.75 * gap + 0.25 * (mono() - start)
        else:
            gap *= 0.75
        c, layer, _version, n, _k, _cid, seq, _ = req_hdr.tolist()
        if c < 0:
            os._exit(0)
        resp.copy_(req)
        seen = c
        pack_response(flags, 72, layer, 0, n, 0, seq)
        flags[8] = c
        _acquire()
        _release()
        if flags[_RESP_WAITING]:
            sock.send(b"D")


class ProtoClient:
    """Client end of the prototype; :meth:`round_trips` runs the shm client's policy (spin at
    least ``spin_s`` and up to 1.5x the recent round trip, at most 2 ms, then block).

    Args:
        n, hidden, k, dtype: the frame: ``[n, hidden]`` rows, ``[n, k]`` experts / weights.
        spin_s: the spin time of both ends, seconds.
        server_cpu: pin the server process to this CPU (None: no pinning).
    """

    def __init__(
        self,
        n: int,
        hidden: int,
        k: int,
        dtype: torch.dtype,
        spin_s: float,
        server_cpu: int | None = None,
    ):
        self.p = p = ProtoBuffer(n, hidden, k, dtype)
        self.spin_s = spin_s
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - child
            try:
                if server_cpu is not None:
                    os.sched_setaffinity(0, {server_cpu})
                p.client_sock.close()
                _proto_server(p, spin_s)
            finally:
                os._exit(1)
        p.server_sock.close()
        self.counter = 0
        self.rtt = 0.0

    def round_trips(
        self, h: torch.Tensor, ex: torch.Tensor, w: torch.Tensor, iters: int, bar
    ) -> list[float]:
        """``iters`` round trips of ``h`` / ``ex`` / ``w``; latencies in seconds."""
        p, spin_s = self.p, self.spin_s
        sock, flags, resp_hdr = p.client_sock, p.flags, p.resp_hdr
        n, k = ex.shape
        out = torch.empty_like(h)
        lat, rtt = [], self.rtt
        mono, yld = time.monotonic, os.sched_yield
        for i in range(self.counter + 1, self.counter + iters + 1):
            t0 = time.perf_counter()
            p.req.copy_(h)
            p.experts.copy_(ex)
            p.weights.copy_(w)
            pack_request(flags, 8, 0, 1, n, k, 1, i)  # layer, table version, n, k, client, seq
            flags[0] = i
            sent = mono()
            _acquire()
            _release()
            if flags[_REQ_WAITING]:
                sock.send(b"D")
            if flags[8] != i:
                end = mono() + max(spin_s, min(_MAX_SPIN_S, 1.5 * rtt))
                while flags[8] != i and mono() < end:
                    yld()
                if flags[8] != i:
                    _proto_block(flags, 8, i - 1, _RESP_WAITING, sock)
            rtt = 0.75 * rtt + 0.25 * (mono() - sent)
            _, _layer, status, _n, _ln, _seq, _, _ = resp_hdr.tolist()
            if status:
                raise RuntimeError(f"prototype echo failed: status {status}")
            out.copy_(p.resp)
            lat.append(time.perf_counter() - t0)
            bar.update(1)
        self.counter += iters
        self.rtt = rtt
        assert torch.equal(out, h)
        return lat

    def close(self) -> None:
        flags = self.p.flags
        flags[0] = -1
        _acquire()
        _release()
        if flags[_REQ_WAITING]:
            self.p.client_sock.send(b"D")
        os.waitpid(self.pid, 0)
        self.p.client_sock.close()
