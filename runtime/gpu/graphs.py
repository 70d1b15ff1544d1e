"""CUDA graphs of the decode MoE round trip (dispatch, wait, combine), one per batch-size bucket.

EaaS paper: CUDA graphs end to end are worth 91.9% of decode throughput (no CPU launches on the
decode path). :class:`DecodeRoundTripGraph` captures, over one ``cudaipc`` connection with a
CUDA payload (:mod:`eaas.runtime.transport.cuda_ipc`):

1. dispatch: copy the static inputs (hidden ``[B, H]``, experts / weights ``[B, k]``) into the
   connection's request slot, then ``eaas_bump_and_signal`` increments a device-side counter and
   stores it, after a system fence, into the request header's ready word (host memory
   registered with ``cudaHostRegister``, so the server's host loop sees it);
2. wait: ``eaas_wait_flag`` spins on the response header's done word until it equals that
   counter or ``timeout_ns`` passes (bounded: a dead server never hangs the stream), writing the
   outcome to a status word;
3. combine: copy the response slot's ``[B, H]`` into the static output.

The host only replays, rings the connection's doorbell (so an idle server wakes and spins on
the flag) and, via :meth:`DecodeRoundTripGraph.check`, reads the status word: a timed-out wait
raises :class:`DeadlineExceeded` just like ``recv`` (the host watchdog half of the deadline).

Buckets: a decode batch of ``n`` rows runs in the smallest captured bucket ``B >= n``
(:func:`choose_bucket`); rows ``n..B-1`` are padding (expert ``-1``: the server computes
nothing for them). Frame header fields other than the counter are fixed per bucket and written
by the host before each replay.

GPU only; nothing here has run on a GPU yet (see docs/gpu.md). :func:`choose_bucket` and
:func:`default_buckets` are pure and tested on the CPU.
"""

from __future__ import annotations

import ctypes

import torch

from eaas.runtime.transport.base import DeadlineExceeded


def default_buckets(max_batch: int) -> list[int]:
    """Powers of two up to ``max_batch`` (and ``max_batch`` itself): 1, 2, 4, ..., max."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def choose_bucket(n: int, buckets: list[int]) -> int:
    """Smallest bucket ``>= n``. Raises ValueError when ``n`` exceeds every bucket or is < 1."""
    if n < 1:
        raise ValueError(f"batch must be >= 1, got {n}")
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"batch {n} exceeds the largest captured bucket {max(buckets)}")


def _mapped_device_ptr(np_view) -> int:
    """Register the page under a numpy view of a memfd mapping; return its device address."""
    from cuda.bindings import runtime as cudart

    page = 4096
    addr = np_view.ctypes.data
    base = addr - addr % page
    err, *_ = cudart.cudaHostRegister(
        base, page, cudart.cudaHostRegisterMapped | cudart.cudaHostRegisterPortable
    )
    if int(err) not in (0, int(cudart.cudaError_t.cudaErrorHostMemoryAlreadyRegistered)):
        raise RuntimeError(f"cudaHostRegister: {err!r}")
    err, dptr = cudart.cudaHostGetDevicePointer(base, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer: {err!r}")
    return int(dptr) + (addr - base)


class DecodeRoundTripGraph:
    """Captured MoE round trips over one ``cudaipc`` connection, one graph per bucket.

    Args:
        conn: a :class:`~eaas.runtime.transport.cuda_ipc.CudaIpcClientConnection` with
            ``payload="cuda"`` and capacity for the largest bucket.
        buckets: batch sizes to capture (see :func:`choose_bucket`).
        k: expert entries per token in the frames.
        layer, table_version: header fields of the frames.
        timeout_ns: bound of the device-side wait.

    Use: :meth:`capture` once, then per step :meth:`run` (copy inputs, replay, ring) and
    :meth:`check` (raises DeadlineExceeded when the wait timed out).
    """

    def __init__(self, conn, buckets: list[int], k: int, *, layer: int = 1,
                 table_version: int = 1, timeout_ns: int = 2_000_000_000):  # fmt: skip
        from eaas.runtime.gpu.build import load_module

        if conn.payload is None or not conn.payload.is_cuda:
            raise ValueError("DecodeRoundTripGraph needs a cudaipc connection with payload='cuda'")
        if max(buckets) > conn.payload.cap_tokens or k > conn.payload.cap_k:
            raise ValueError(
                "connection slot smaller than the largest bucket; connect with max_tokens"
            )
        self.conn, self.k, self.layer, self.table_version = conn, k, layer, table_version
        self.buckets = sorted(set(buckets))
        self.timeout_ns = int(timeout_ns)
        self.mod = load_module("eaas_signal.cu")
        dev = conn.payload.raw.device
        H = conn.hidden_size
        self.req_flag = _mapped_device_ptr(conn.headers.req[0:1])
        self.resp_flag = _mapped_device_ptr(conn.headers.resp[0:1])
        # device-side frame counter, continuing the connection's (host) counter
        self.counter = torch.full((1,), conn._counter, dtype=torch.int64, device=dev)  # noqa: SLF001
        self.status = torch.zeros(1, dtype=torch.int32, device=dev)
        Bm = self.buckets[-1]
        self.hidden = torch.zeros(Bm, H, dtype=conn.dtype, device=dev)
        self.experts = torch.full((Bm, k), -1, dtype=torch.int32, device=dev)
        self.weights = torch.zeros(Bm, k, dtype=torch.float32, device=dev)
        self.out = torch.zeros(Bm, H, dtype=conn.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _round_trip(self, B: int) -> None:
        p, k = self.conn.payload, self.k
        p.req_hidden[:B].copy_(self.hidden[:B])
        p.req_experts[: B * k].view(B, k).copy_(self.experts[:B])
        p.req_weights[: B * k].view(B, k).copy_(self.weights[:B])
        flag_t = ctypes.c_void_p
        self.mod.launch("eaas_bump_and_signal", (1,), (1,), [self.counter, flag_t(self.req_flag)])
        self.mod.launch(
            "eaas_wait_flag",
            (1,),
            (1,),
            [
                flag_t(self.resp_flag),
                self.counter,
                ctypes.c_ulonglong(self.timeout_ns),
                self.status,
            ],
        )
        self.out[:B].copy_(p.resp_out[:B])

    def capture(self) -> None:
        """Capture one graph per bucket (no server traffic during capture)."""
        for B in self.buckets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._round_trip(B)
            self.graphs[B] = g

    def run(
        self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One round trip of ``n`` rows in its bucket; returns the output view ``[n, H]``
        (valid after :meth:`check`)."""
        n = int(hidden.shape[0])
        B = choose_bucket(n, self.buckets)
        self.hidden[:n].copy_(hidden)
        self.experts[:n].copy_(experts)
        self.experts[n:B].fill_(-1)
        self.weights[:n].copy_(weights)
        hdr = self.conn.headers.req
        hdr[1], hdr[2], hdr[3], hdr[4] = self.layer, self.table_version, B, self.k
        hdr[5], hdr[6], hdr[7] = self.conn.client_id, 0, self.conn._gen  # noqa: SLF001
        self.conn._counter += 1  # noqa: SLF001 - the device counter advances in step
        self.graphs[B].replay()
        self.conn._sock.send(b"D")  # noqa: SLF001 - doorbell: wake the server to spin on the flag
        return self.out[:n]

    def check(self) -> None:
        """Wait for the replay; raise DeadlineExceeded when the device-side wait timed out."""
        torch.cuda.current_stream().synchronize()
        if int(self.status.item()) != 0:
            raise DeadlineExceeded(
                f"expert server {self.conn.server_id}: no response within {self.timeout_ns} ns "
                "(device-side wait)"
            )
