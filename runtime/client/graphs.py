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

Step 1 is one graph, steps 2-3 another: between them the host waits for the first and rings
the connection's doorbell when the server sleeps (so an idle server never misses the flag), and
:meth:`DecodeRoundTripGraph.check` reads the status word: a timed-out wait raises
:class:`DeadlineExceeded` just like ``recv`` (the host watchdog half of the deadline).

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

from eaas.runtime.cuda.nvrtc import load_module
from eaas.runtime.transport.base import DeadlineExceeded
from eaas.runtime.transport.shm_slots import fence


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
    # lazy: cuda-python is an optional dependency (GPU installs only)
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
    """Captured MoE round trips over one ``cudaipc`` connection, two graphs per bucket.

    Args:
        conn: a :class:`~eaas.runtime.transport.cuda_ipc.CudaIpcClientConnection` with
            ``payload="cuda"`` and capacity for the largest bucket (``max_tokens``, ``max_k``:
            the graphs capture the slot's addresses, so the slot must never be remapped).
        buckets: batch sizes to capture (see :func:`choose_bucket`).
        k: expert entries per token in the frames.
        layer, table_version: default header fields of the frames (:meth:`run` may override
            them per call: they are host-written header words, not captured).
        timeout_ns: bound of the device-side wait.

    Per bucket ``B``: graph ``dispatch`` = copy-in (hidden ``[B, H]``, experts / weights
    ``[B, k]`` into the request slot) + ``eaas_bump_and_signal`` (device counter -> request
    ready word); graph ``combine`` = ``eaas_wait_flag`` (bounded) + copy-out ``[B, H]``. Between
    the two the host waits for the dispatch graph (copy-in and flag are on the device) and rings
    the doorbell when the server sleeps in ``select`` (shm's waiting flag), so a server never
    misses a frame whose flag the GPU wrote after a doorbell.

    Use: :meth:`capture` once, then per step :meth:`run` and :meth:`check` (raises
    DeadlineExceeded when the device-side wait timed out).

    Raises:
        ValueError: a host-payload connection, or a slot smaller than the largest bucket.
        GpuUnavailableError: no CUDA / cuda-python (from :func:`~eaas.runtime.cuda.nvrtc.load_module`).
    """

    def __init__(self, conn, buckets: list[int], k: int, *, layer: int = 1,
                 table_version: int = 1, timeout_ns: int = 2_000_000_000):  # fmt: skip
        s = conn.slots
        if not s.is_cuda:
            raise ValueError("DecodeRoundTripGraph needs a cudaipc connection with payload='cuda'")
        if max(buckets) > s.cap_tokens or k > s.cap_k:
            raise ValueError(
                "connection slot smaller than the largest bucket; connect with max_tokens"
            )
        self.conn, self.k, self.layer, self.table_version = conn, k, layer, table_version
        self.buckets = sorted(set(buckets))
        self.timeout_ns = int(timeout_ns)
        self.mod = load_module("eaas_signal.cu")
        self.slots = s
        dev = s.raw.device
        H = conn.hidden_size
        self.req_flag = _mapped_device_ptr(s.req_hdr[0:1])
        self.resp_flag = _mapped_device_ptr(s.resp_hdr[0:1])
        # device-side frame counter, continuing the connection's (host) counter
        self.counter = torch.full((1,), conn._counter, dtype=torch.int64, device=dev)  # noqa: SLF001
        self.status = torch.zeros(1, dtype=torch.int32, device=dev)
        Bm = self.buckets[-1]
        self.hidden = torch.zeros(Bm, H, dtype=conn.dtype, device=dev)  # (Bm, H)
        self.experts = torch.full((Bm, k), -1, dtype=torch.int32, device=dev)  # (Bm, k)
        self.weights = torch.zeros(Bm, k, dtype=torch.float32, device=dev)  # (Bm, k)
        self.out = torch.zeros(Bm, H, dtype=conn.dtype, device=dev)  # (Bm, H)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        # one stream per connection: round trips to several servers are in flight together
        self.stream = torch.cuda.Stream(device=dev)

    def _dispatch(self, B: int) -> None:
        s, k = self.slots, self.k
        s.req_hidden[:B].copy_(self.hidden[:B])
        s.req_experts[: B * k].view(B, k).copy_(self.experts[:B])
        s.req_weights[: B * k].view(B, k).copy_(self.weights[:B])
        flag_t = ctypes.c_void_p
        self.mod.launch("eaas_bump_and_signal", (1,), (1,), [self.counter, flag_t(self.req_flag)])

    def _combine(self, B: int) -> None:
        self.mod.launch(
            "eaas_wait_flag",
            (1,),
            (1,),
            [
                ctypes.c_void_p(self.resp_flag),
                self.counter,
                ctypes.c_ulonglong(self.timeout_ns),
                self.status,
            ],
        )
        self.out[:B].copy_(self.slots.resp_out[:B])

    def capture(self) -> None:
        """Capture the dispatch and combine graphs of every bucket (no server traffic)."""
        for B in self.buckets:
            gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(gd, stream=self.stream):
                self._dispatch(B)
            with torch.cuda.graph(gc, stream=self.stream):
                self._combine(B)
            self.graphs[B] = (gd, gc)

    def run(
        self,
        hidden: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        *,
        layer: int | None = None,
        table_version: int | None = None,
    ) -> torch.Tensor:
        """One round trip of ``n`` rows in its bucket: ``hidden`` ``[n, H]``, ``experts``
        ``[n, k]`` int32, ``weights`` ``[n, k]`` float32 (CUDA). Returns the output view
        ``[n, H]`` (valid after :meth:`check`).

        Raises:
            ValueError: ``n`` above the largest bucket.
        """
        n = int(hidden.shape[0])
        B = choose_bucket(n, self.buckets)
        st = self.stream
        st.wait_stream(torch.cuda.current_stream(st.device))  # the caller's inputs are ready
        with torch.cuda.stream(st):
            self.hidden[:n].copy_(hidden, non_blocking=True)
            self.experts[:n].copy_(experts, non_blocking=True)
            self.experts[n:B].fill_(-1)  # padding rows: no expert, the server computes nothing
            self.weights[:n].copy_(weights, non_blocking=True)
            hdr = self.slots.req_hdr
            hdr[1] = self.layer if layer is None else layer
            hdr[2] = self.table_version if table_version is None else table_version
            hdr[3], hdr[4], hdr[5], hdr[6] = B, self.k, self.conn.client_id, 0
            # the device counter continues the connection's (eager sends advance it on the host)
            self.counter.fill_(self.conn._counter)  # noqa: SLF001
            self.conn._counter += 1  # noqa: SLF001 - the graph's bump matches this
            gd, gc = self.graphs[B]
            gd.replay()
            st.synchronize()  # copy-in and the ready flag are done
            fence()
            if hdr[7]:  # the server sleeps in select: wake it (shm's doorbell rule)
                self.conn._sock.send(b"D")  # noqa: SLF001
            gc.replay()
        return self.out[:n]

    def check(self) -> None:
        """Wait for the replay.

        Raises:
            DeadlineExceeded: the device-side wait timed out (server dead or stopped).
            RuntimeError: the server answered an error status (its message included).
        """
        self.stream.synchronize()
        if int(self.status.item()) != 0:
            raise DeadlineExceeded(
                f"expert server {self.conn.server_id}: no response within {self.timeout_ns} ns "
                "(device-side wait)"
            )
        hdr = self.slots.resp_hdr
        if int(hdr[2]) != 0:  # the server answered an error status (e.g. expert not hosted)
            ln = min(int(hdr[4]), len(self.slots.resp_msg))
            msg = bytes(self.slots.resp_msg[:ln]).decode("utf-8", "replace")
            raise RuntimeError(f"error status {int(hdr[2])}: {msg}")


def graph_eligible(
    *, cuda_payload: bool, n: int, k: int, max_bucket: int, cap_tokens: int, cap_k: int
) -> bool:
    """Whether a layer call of ``n`` tokens x ``k`` experts to one server runs as a graph
    replay: the connection's payload is in CUDA memory, ``1 <= n <= max_bucket`` (decode-sized)
    and its slot holds the largest bucket (graphs capture the slot, which must never be
    remapped). Anything else (prefill chunks, host-payload or non-cudaipc connections) takes the
    eager ``send``/``recv`` path."""
    return cuda_payload and 1 <= n <= max_bucket and max_bucket <= cap_tokens and 1 <= k <= cap_k


def check_cuda_graphs(device_type: str, local_experts: bool) -> None:
    """The attention client's ``--cuda-graphs`` preconditions.

    Raises:
        ValueError: the client's device is not CUDA (a CPU has no CUDA graphs), or
            ``--local-experts`` (no expert round trip to capture).
    """
    if device_type != "cuda":
        raise ValueError(
            f"--cuda-graphs needs a CUDA device (--device cuda), got {device_type}: CUDA graphs "
            "capture the decode MoE round trip on the GPU"
        )
    if local_experts:
        raise ValueError(
            "--cuda-graphs captures the round trip to expert servers; it cannot be combined "
            "with --local-experts"
        )


class GraphRoundTrips:
    """The dispatcher's ``--cuda-graphs`` path: one :class:`DecodeRoundTripGraph` per
    ``cudaipc`` connection with a CUDA payload (captured on first use, buckets
    :func:`default_buckets` of ``max_batch``); other connections and larger calls stay eager.

    Args:
        max_batch: largest decode batch (the attention client's ``--max-num-seqs``).
        timeout_s: bound of the device-side wait (the dispatch deadline).
    """

    def __init__(self, max_batch: int, *, timeout_s: float):
        self.buckets = default_buckets(max_batch)
        self.timeout_ns = int(timeout_s * 1e9)
        self.replays = 0  # round trips run as graph replays

    def for_connection(self, conn, n: int, k: int) -> DecodeRoundTripGraph | None:
        """The graph for a call of ``n`` tokens x ``k`` on ``conn``, or None for the eager path."""
        slots = getattr(conn, "slots", None)
        if slots is None or not graph_eligible(
            cuda_payload=bool(getattr(slots, "is_cuda", False)),
            n=n,
            k=k,
            max_bucket=self.buckets[-1],
            cap_tokens=slots.cap_tokens,
            cap_k=slots.cap_k,
        ):
            return None
        cache: dict[int, DecodeRoundTripGraph] = conn.__dict__.setdefault("_eaas_graphs", {})
        g = cache.get(k)
        if g is None:
            g = DecodeRoundTripGraph(conn, self.buckets, k, timeout_ns=self.timeout_ns)
            g.capture()
            cache[k] = g
        self.replays += 1
        return g
