"""Double-batch overlap for decode: one micro-batch's attention runs while the other's experts
compute (EaaS paper, "double-batch overlap": 25.9% of throughput in its ablation; the same
ping-pong as MegaScale-Infer).

Pure scheduling logic, independent of the engine and the transport:

* :func:`split_batch` cuts a decode batch of ``B`` sequences into micro-batches A (first
  ``ceil(B/2)`` rows) and B (the rest). Decode rows are independent sequences, so every per-row
  computation gives the same numbers on a half batch.
* :func:`schedule` lists the operations of ``L`` layers in issue order. Without overlap:
  ``attn(l) -> dispatch(l) -> combine(l)`` for the whole batch. With overlap, per layer::

      attn(A,l)  dispatch(A,l)  attn(B,l)  dispatch(B,l)  combine(A,l)  combine(B,l)

  so ``attn(B,l)`` is issued while A's tokens are at the expert servers, and
  ``attn(A,l+1)`` (right after ``combine(A,l)``) while B's are. Each micro-batch's own
  operations keep their order (attn -> dispatch -> combine -> next layer's attn), which is what
  makes the output identical to overlap off.
* :func:`run_decode_layers` executes a schedule over a :class:`DecodeStack` (the engine's
  per-layer pieces) and concatenates the micro-batches back in order.

Engine hook (docs/gpu.md): the attention client's decode step calls ``run_decode_layers`` with
its layers wrapped as a :class:`DecodeStack` whose ``dispatch`` sends the MoE frames
(``ClientConnection.send``) and returns a handle, and whose ``combine`` waits (``recv`` with the
dispatch deadline) and adds the partial sums and the shared expert. On the GPU the two
micro-batches use two CUDA streams and each micro-batch's round trip is one captured graph
(:mod:`eaas.runtime.gpu.graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


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

    Args:
        num_layers: MoE layers in the step.
        micro_batches: 1 (overlap off) or 2 (double-batch overlap).
    """
    if micro_batches not in (1, 2):
        raise ValueError(f"micro_batches must be 1 or 2, got {micro_batches}")
    ops: list[Op] = []
    for l in range(num_layers):
        if micro_batches == 1:
            ops += [Op("attn", 0, l), Op("dispatch", 0, l), Op("combine", 0, l)]
        else:
            ops += [Op("attn", 0, l), Op("dispatch", 0, l), Op("attn", 1, l), Op("dispatch", 1, l)]
            ops += [Op("combine", 0, l), Op("combine", 1, l)]
    return ops


def run_decode_layers(
    stack: DecodeStack, h: torch.Tensor, num_layers: int, *, overlap: bool
) -> torch.Tensor:
    """Run ``num_layers`` decode layers over ``h`` ``[B, H]``, with or without overlap.

    Returns ``[B, H]``; rows in the input order. Same numbers either way (each row sees the same
    operations in the same order).
    """
    parts = split_batch(int(h.shape[0])) if overlap else [slice(0, int(h.shape[0]))]
    cur = [h[p] for p in parts]
    handles: list[Any] = [None] * len(parts)
    for op in schedule(num_layers, len(parts)):
        m = op.micro
        if op.kind == "attn":
            cur[m] = stack.attention(op.layer, cur[m], parts[m])
        elif op.kind == "dispatch":
            handles[m] = stack.dispatch(op.layer, cur[m], parts[m])
        else:
            cur[m] = stack.combine(op.layer, cur[m], handles[m])
            handles[m] = None
    return torch.cat(cur) if len(cur) > 1 else cur[0]
