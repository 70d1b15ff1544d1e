"""Double-batch overlap for decode: one micro-batch's attention runs while the other's experts
compute (EaaS paper, "double-batch overlap": 25.9% of throughput in its ablation; the same
ping-pong as MegaScale-Infer).

Pure scheduling logic, independent of the engine and the transport:

* :func:`split_batch` cuts a decode batch of ``B`` sequences into micro-batches A (first
  ``ceil(B/2)`` rows) and B (the rest). Decode rows are independent sequences, so every per-row
  computation gives the same numbers on a half batch.
* :func:`schedule` lists the operations of ``L`` layers in issue order. Without overlap:
  ``attn(l) -> dispatch(l) -> combine(l)`` for the whole batch. With overlap, per layer::

      attn(A,0)  dispatch(A,0)  attn(B,0)  dispatch(B,0)

  for the first layer, then ``combine(A,l) attn(A,l+1) dispatch(A,l+1) combine(B,l)
  attn(B,l+1) dispatch(B,l+1)``: ``attn(B,l)`` is issued while A's tokens are at the expert
  servers, and ``attn(A,l+1)`` (right after ``combine(A,l)``) while B's are. Each micro-batch's own
  operations keep their order (attn -> dispatch -> combine -> next layer's attn), which is what
  makes the output identical to overlap off.
* :func:`run_decode_layers` executes a schedule over a :class:`DecodeStack` (the engine's
  per-layer pieces) and concatenates the micro-batches back in order.

Engine hook: :class:`PagedOverlapRunner` wraps the engine's
:class:`~eaas.runtime.client.model_runner.PagedModelRunner` (``Engine(double_batch_overlap=True)``,
``eaas attention-client --double-batch-overlap``, ``eaas serve --double-batch-overlap``). For a
decode-only step of two or more sequences its ``dispatch`` runs the layer's MoE block (router,
shared expert, the routed experts' round trip through
:class:`~eaas.runtime.client.moe.RemoteExperts`) on one worker thread and ``combine``
waits for it, so the scheduler thread computes the other micro-batch's attention while the
expert servers work. Other steps (prefill chunks, one sequence) run the wrapped runner as is.
On a CUDA device each micro-batch's work is issued on its own CUDA stream
(:class:`MicroBatchStreams`): both streams first wait for the step's producer (the current
stream), the MoE worker waits for an event recorded after the micro-batch's attention, the
micro-batch's stream waits for an event recorded after its MoE call, and the current stream
waits for both streams at the end; tensors crossing streams are ``record_stream``-ed so the
caching allocator never reuses them early. On the CPU all of this is a no-op. (Each
micro-batch's round trip as one captured graph, :mod:`eaas.runtime.client.graphs`, is not wired
into the overlap runner: docs/gpu.md.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from eaas.runtime.client.model_runner import Chunk, PagedModelRunner


class DecodeStack(Protocol):
    """The per-layer pieces of a decode step, for any micro-batch (row subset).

    ``attention(layer, h, rows)`` -> ``h'`` ``[b, H]`` (attention + residual for those rows'
    sequences); ``dispatch(layer, h, rows)`` -> a handle (MoE frames sent, not waited);
    ``combine(layer, h, handle)`` -> ``h''`` ``[b, H]`` (wait for the experts, add the partial
    sums and the shared expert). ``rows`` is a ``slice`` of the full batch.
    """

    def attention(self, layer: int, h: torch.Tensor, rows: slice) -> torch.Tensor: ...

    def dispatch(self, layer: int, h: torch.Tensor, rows: slice) -> Any: ...

    def combine(self, layer: int, h: torch.Tensor, handle: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class Op:
    """One scheduled operation: ``kind`` in ``attn | dispatch | combine``, micro-batch index
    (0 = A, 1 = B; always 0 without overlap) and layer index."""

    kind: str
    micro: int
    layer: int


def split_batch(batch: int) -> list[slice]:
    """Row ranges of the micro-batches: ``[A, B]`` with ``len(A) = ceil(batch/2)``; a batch of
    one row cannot be split and gives ``[A]``. Raises ValueError for ``batch < 1``."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if batch == 1:
        return [slice(0, 1)]
    half = (batch + 1) // 2
    return [slice(0, half), slice(half, batch)]


def schedule(num_layers: int, micro_batches: int) -> list[Op]:
    """Issue order of the decode step's operations (see module doc).

    With two micro-batches the order is the ping-pong::

        attn(A,0) dispatch(A,0) attn(B,0) dispatch(B,0)
        combine(A,l) attn(A,l+1) dispatch(A,l+1) combine(B,l) attn(B,l+1) dispatch(B,l+1) ...

    so every attention after the first is issued while the other micro-batch's MoE round trip
    is in flight (``2L - 1`` of the ``2L`` attentions overlap a round trip).

    Args:
        num_layers: MoE layers in the step.
        micro_batches: 1 (overlap off) or 2 (double-batch overlap).

    Raises:
        ValueError: ``micro_batches`` not 1 or 2, ``num_layers < 0``.
    """
    if micro_batches not in (1, 2):
        raise ValueError(f"micro_batches must be 1 or 2, got {micro_batches}")
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    ops: list[Op] = []
    if micro_batches == 1:
        for l in range(num_layers):
            ops += [Op("attn", 0, l), Op("dispatch", 0, l), Op("combine", 0, l)]
        return ops
    if num_layers == 0:
        return ops
    ops += [Op("attn", 0, 0), Op("dispatch", 0, 0), Op("attn", 1, 0), Op("dispatch", 1, 0)]
    for l in range(num_layers):
        for m in (0, 1):
            ops.append(Op("combine", m, l))
            if l + 1 < num_layers:
                ops += [Op("attn", m, l + 1), Op("dispatch", m, l + 1)]
    return ops


class MicroBatchStreams:
    """One CUDA stream per micro-batch on a CUDA device; every method a no-op on the CPU.

    Ordering (all on the device, the host never waits): :meth:`start` makes each micro-batch
    stream wait for the current stream (the step's inputs); :meth:`on` issues a micro-batch's
    work on its stream; :meth:`finish` makes the current stream wait for every micro-batch
    stream. Work handed to another thread (the MoE worker) is ordered with :func:`record_event`
    / :func:`wait_event` (events, not stream syncs).

    Args:
        device: the step's device (``cuda``: streams; anything else: no-ops).
        micro_batches: how many streams (1 or 2).

    Attributes:
        streams: the ``torch.cuda.Stream`` per micro-batch (empty on the CPU).
    """

    def __init__(self, device: torch.device, micro_batches: int):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.streams: list[Any] = (
            [torch.cuda.Stream(self.device) for _ in range(micro_batches)] if self.cuda else []
        )

    def start(self, inputs: torch.Tensor) -> None:
        """Each micro-batch stream waits for the current stream, which produced ``inputs``
        (``inputs`` is kept alive for those streams)."""
        if not self.cuda:
            return
        cur = torch.cuda.current_stream(self.device)
        for st in self.streams:
            st.wait_stream(cur)
            inputs.record_stream(st)

    @contextlib.contextmanager
    def on(self, micro: int) -> Iterator[None]:
        """Issue the block's CUDA work on micro-batch ``micro``'s stream (CPU: nothing)."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.streams[micro]):
            yield

    def finish(self, outputs: list[torch.Tensor]) -> None:
        """The current stream waits for every micro-batch stream; ``outputs`` (made on those
        streams) are kept alive for the current stream."""
        if not self.cuda:
            return
        cur = torch.cuda.current_stream(self.device)
        for st in self.streams:
            cur.wait_stream(st)
        for t in outputs:
            t.record_stream(cur)


def record_event(device: torch.device) -> Any:
    """An event recorded on this thread's current CUDA stream of ``device``; None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def wait_event(event: Any, device: torch.device, *tensors: torch.Tensor) -> None:
    """This thread's current CUDA stream waits for ``event`` (None: nothing to wait for); the
    ``tensors`` it will read (made on another stream) are kept alive for it."""
    if event is None:
        return
    st = torch.cuda.current_stream(device)
    st.wait_event(event)
    for t in tensors:
        t.record_stream(st)


def run_decode_layers(
    stack: DecodeStack,
    h: torch.Tensor,
    num_layers: int,
    *,
    overlap: bool,
    streams: MicroBatchStreams | None = None,
) -> torch.Tensor:
    """Run ``num_layers`` decode layers over ``h`` ``[B, H]``, with or without overlap.

    Returns ``[B, H]``; rows in the input order. Same numbers either way (each row sees the same
    operations in the same order). On a CUDA device each micro-batch's operations are issued
    on its own stream (``streams``, default :class:`MicroBatchStreams` of ``h.device``).
    """
    parts = split_batch(int(h.shape[0])) if overlap else [slice(0, int(h.shape[0]))]
    if streams is None:
        streams = MicroBatchStreams(h.device, len(parts))
    streams.start(h)
    cur = [h[p] for p in parts]
    handles: list[Any] = [None] * len(parts)
    for op in schedule(num_layers, len(parts)):
        m = op.micro
        with streams.on(m):
            if op.kind == "attn":
                cur[m] = stack.attention(op.layer, cur[m], parts[m])
            elif op.kind == "dispatch":
                handles[m] = stack.dispatch(op.layer, cur[m], parts[m])
            else:
                cur[m] = stack.combine(op.layer, cur[m], handles[m])
                handles[m] = None
    streams.finish(cur)
    return torch.cat(cur) if len(cur) > 1 else cur[0]


class _PagedStack:
    """:class:`DecodeStack` over a :class:`PagedModelRunner`'s layers for one decode step.

    ``metas[m]`` is the batch metadata of micro-batch ``m`` (rows relative to the micro-batch);
    ``dispatch`` submits ``post_attention_layernorm`` + the MoE block to ``pool`` (one worker:
    the dispatcher serialises layer calls anyway) and returns the future.
    """

    def __init__(self, owner: PagedOverlapRunner, metas: dict[int, Any]):
        self.owner = owner
        self.runner = owner.runner
        self.layers = self.runner.model.model.layers
        self.metas = metas  # rows.start -> _Meta
        self.pending: list[Future] = []

    def attention(self, layer: int, h: torch.Tensor, rows: slice) -> torch.Tensor:
        self.owner._note_attention()
        blk = self.layers[layer]
        meta = self.metas[rows.start]
        a_in = blk.input_layernorm(h)  # (b, H)
        if self.runner.mla:
            a = self.runner._mla(layer, blk.self_attn, a_in, meta)
        else:
            a = self.runner._gqa(layer, blk.self_attn, a_in, meta)
        return h + a  # (b, H)

    def dispatch(self, layer: int, h: torch.Tensor, rows: slice) -> Future:
        blk = self.layers[layer]
        dev = h.device
        ready = record_event(dev)  # after this micro-batch's attention (its stream; CPU: None)

        def moe() -> tuple[torch.Tensor, Any]:
            with torch.inference_mode():  # thread-local: the worker needs its own
                self.owner._moe_begin()
                try:
                    wait_event(ready, dev, h)  # the worker's stream waits for the attention
                    m = blk.mlp(blk.post_attention_layernorm(h)[None])  # (1, b, H)
                    out = (m[0] if isinstance(m, tuple) else m)[0]  # (b, H)
                    return out, record_event(dev)
                finally:
                    self.owner._moe_end()

        fut = self.owner._pool.submit(moe)
        self.pending.append(fut)
        return fut

    def combine(self, layer: int, h: torch.Tensor, handle: Future) -> torch.Tensor:
        out, done = handle.result()  # the dispatcher's own deadline bounds the wait
        wait_event(done, h.device, out)  # this micro-batch's stream waits for its MoE call
        return h + out

    def drain(self) -> None:
        """Wait for every MoE call still running (after an error): none outlives the step."""
        for f in self.pending:
            try:
                f.result()
            except Exception:  # noqa: BLE001  (the first error is already propagating)
                pass


class PagedOverlapRunner:
    """Double-batch overlap around a :class:`~eaas.runtime.client.model_runner.PagedModelRunner`.

    ``forward(chunks)`` has the wrapped runner's contract (``(B, vocab)`` float32 logits of the
    chunks with ``want_logits``). A step whose chunks are all decode tokens (one token each) and
    number at least two runs as two micro-batches (:func:`split_batch` over the chunks) with the
    ping-pong :func:`schedule`: the MoE block of one micro-batch runs on a worker thread while
    the scheduler thread computes the other's attention. Every other step runs
    ``runner.forward`` unchanged. Greedy tokens equal overlap off (each sequence sees the same
    operations; only GEMM row counts differ, i.e. float reassociation).

    Attributes:
        stats: ``overlap_steps`` (steps run as two micro-batches), ``plain_steps`` (the rest),
            ``attn_during_moe`` (attentions issued while a MoE call was running on the worker:
            the overlap actually achieved).

    Args:
        runner: the engine's runner (its model may hold ``RemoteExperts`` or local experts).
    """

    def __init__(self, runner: PagedModelRunner):
        self.runner = runner
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eaas-dbo-moe")
        self._lock = threading.Lock()
        self._moe_running = 0
        self.stats = {"overlap_steps": 0, "plain_steps": 0, "attn_during_moe": 0}

    # proxies the engine reads
    @property
    def model(self):
        return self.runner.model

    @property
    def cache(self):
        return self.runner.cache

    def _moe_begin(self) -> None:
        with self._lock:
            self._moe_running += 1

    def _moe_end(self) -> None:
        with self._lock:
            self._moe_running -= 1

    def _note_attention(self) -> None:
        with self._lock:
            if self._moe_running:
                self.stats["attn_during_moe"] += 1

    def close(self) -> None:
        """Stop the worker thread (waits for a running MoE call)."""
        self._pool.shutdown(wait=True)

    def forward_full(self, chunks: list[Chunk]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`PagedModelRunner.forward_full`: a step asking for every position's logits
        (prompt logprobs) is a prefill step and runs plain; any other step as :meth:`forward`."""
        if any(c.all_logits for c in chunks):
            self.stats["plain_steps"] += 1
            return self.runner.forward_full(chunks)
        return self.forward(chunks), {}

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """One step; see the class doc. Returns ``(B, vocab)`` float32."""
        if len(chunks) < 2 or any(len(c.token_ids) != 1 for c in chunks):
            self.stats["plain_steps"] += 1
            return self.runner.forward(chunks)
        r = self.runner
        inner = r.model.model
        ids = torch.tensor([c.token_ids[0] for c in chunks], dtype=torch.long)  # (B,)
        x = inner.embed_tokens(ids.to(r.device))  # (B, H)
        parts = split_batch(len(chunks))
        metas = {p.start: r._meta(chunks[p], x[p]) for p in parts}
        stack = _PagedStack(self, metas)
        try:
            x = run_decode_layers(stack, x, len(inner.layers), overlap=True)  # (B, H)
        except BaseException:
            stack.drain()
            raise
        self.stats["overlap_steps"] += 1
        ends = [i for i, c in enumerate(chunks) if c.want_logits]
        x = inner.norm(x[torch.tensor(ends, dtype=torch.long, device=r.device)])  # (b, H)
        return r.model.lm_head(x).float()  # (b, V)
