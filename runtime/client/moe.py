"""The MoE seam: what a model's MoE block calls to run its routed experts on expert servers.

:class:`RemoteExperts` replaces a model's routed-experts module (``experts_factory`` of
:func:`eaas.runtime.models.attention.load_attention_model`); the model's own router and shared
expert stay local, so the MoE block computes ``shared(x) + RemoteExperts(x, top_k_index,
top_k_weights)``. :func:`overlapped_moe_forward` gives a DeepSeek-V3 MoE block a forward that
computes the shared expert while the routed experts run on the servers.

The seam depends on the :class:`ExpertDispatch` interface only; the attention client's
implementation is :class:`eaas.runtime.client.dispatch.Dispatcher`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn


class PendingExperts(Protocol):
    """One routed-experts call in flight (``Dispatcher.dispatch_begin``'s result)."""

    def wait(self) -> torch.Tensor:
        """Wait for the expert servers and combine: ``[T, H]`` in the input's dtype and device."""
        ...


class ExpertDispatch(Protocol):
    """What the seam calls: one MoE layer's routed experts over the expert servers.

    Attributes:
        client_id: the attention client's id (shown by :meth:`RemoteExperts.extra_repr`).
    """

    client_id: int

    def dispatch_begin(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> PendingExperts:
        """Send layer ``layer``'s frames: ``hidden`` ``[T, H]``, ``top_k_index`` ``[T, k]`` int64
        (-1 = none), ``top_k_weights`` ``[T, k]``; the result's ``wait()`` gives ``[T, H]`` =
        ``sum_j w[t, j] * E_{idx[t, j]}(hidden[t])``."""
        ...


class RemoteExperts(nn.Module):
    """Drop-in replacement of a model's routed-experts module that runs them on expert servers.

    ``forward(hidden [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]`` (same
    signature as transformers' ``*Experts`` modules); holds no weights.
    """

    def __init__(self, dispatcher: ExpertDispatch, layer_idx: int):
        super().__init__()
        self.dispatcher = dispatcher
        self.layer_idx = int(layer_idx)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        d = self.dispatcher  # (the dispatcher's own dispatch() is this same begin + wait)
        return d.dispatch_begin(self.layer_idx, hidden_states, top_k_index, top_k_weights).wait()

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, client_id={self.dispatcher.client_id}"


def overlapped_moe_forward(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A forward for ``block`` that computes its shared expert while the routed experts run on
    the expert servers, or None when ``block`` is not a DeepSeek-V3 MoE block with
    :class:`RemoteExperts`.

    transformers' ``DeepseekV3MoE.forward`` computes ``gate -> experts -> + shared_experts``;
    this one does ``gate -> send frames (dispatch_begin) -> shared_experts -> wait -> routed +
    shared``: the same operations on the same tensors in the same order of addition, so the
    result is bit-identical (the MoE layer ``y = shared(x) + sum_i g_i E_i(x)``), but the
    attention client's shared-expert work no longer waits for the round trip. Qwen3-MoE and
    Mixtral blocks have no shared expert and keep their own forward.

    Returns:
        ``fn(hidden [B, S, H]) -> [B, S, H]`` (the block's output, as its ``forward``), or None.
    """
    experts = getattr(block, "experts", None)
    if not isinstance(experts, RemoteExperts):
        return None
    # lazy: importing transformers' DeepSeek-V3 modeling module takes seconds, and only a block
    # with remote experts (a model already loaded from transformers) needs it
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    if type(block) is not DeepseekV3MoE:
        return None
    if type(block).forward is not DeepseekV3MoE.forward:  # pragma: no cover (patched class)
        return None
    gate, shared, dispatcher, layer = (
        block.gate,
        block.shared_experts,
        experts.dispatcher,
        experts.layer_idx,
    )

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape  # (B, S, H)
        _, topk_weights, topk_indices = gate(hidden_states)  # (T, k), (T, k)
        flat = hidden_states.view(-1, hidden_states.shape[-1])  # (T, H)
        pending = dispatcher.dispatch_begin(layer, flat, topk_indices, topk_weights)
        try:
            shared_out = shared(hidden_states)  # (B, S, H), while the servers compute
        finally:
            routed = pending.wait()  # (T, H); always waited: the dispatcher's lock
        return routed.view(*orig_shape) + shared_out

    return forward


def experts_factory(dispatcher: ExpertDispatch) -> Callable[[int, object], RemoteExperts]:
    """``experts_factory`` for ``load_attention_model``: ``(layer_idx, info) -> RemoteExperts``."""

    def make(layer_idx: int, info: object = None) -> RemoteExperts:
        return RemoteExperts(dispatcher, layer_idx)

    return make
