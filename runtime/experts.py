"""Routed-expert math shared by expert servers and tests.

An expert is a pure function of one token's hidden state (no sequence state), which is what lets
EaaS replicate, move and scale experts freely. All three supported architectures (DeepSeek-V3,
Qwen3-MoE, Mixtral) use a SwiGLU expert::

    E(x) = W_down (silu(W_gate x) * (W_up x))

Source: DeepSeek-V3 technical report (arXiv:2412.19437) section 2.1.2; Mixtral (arXiv:2401.04088).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ExpertWeights:
    """Weights of one routed expert.

    Attributes:
        gate: ``[intermediate, hidden]`` (``W_gate``; Mixtral's ``w1``).
        up: ``[intermediate, hidden]`` (``W_up``; Mixtral's ``w3``).
        down: ``[hidden, intermediate]`` (``W_down``; Mixtral's ``w2``).
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @property
    def gate_up(self) -> torch.Tensor:
        """``[2 * intermediate, hidden]``: gate rows then up rows (transformers' fused layout)."""
        return torch.cat([self.gate, self.up], dim=0)

    def to(self, target: torch.device | torch.dtype) -> ExpertWeights:
        """The three tensors moved to a device or cast to a dtype (``Tensor.to``: a tensor
        already there is kept, not copied)."""
        return ExpertWeights(self.gate.to(target), self.up.to(target), self.down.to(target))


def expert_forward(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """Apply one SwiGLU expert.

    Args:
        x: ``[n, hidden]``, same dtype as the weights.
        w: the expert's weights.

    Returns:
        ``[n, hidden]``.
    """
    g = F.linear(x, w.gate)  # (n, I)
    u = F.linear(x, w.up)  # (n, I)
    return F.linear(F.silu(g) * u, w.down)  # (n, H)


def weighted_expert_sum(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    hosted: dict[int, ExpertWeights],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token weighted sum of the selected experts, each expert run once on all its tokens.

    Args:
        hidden: ``[n, hidden]`` tokens.
        experts: ``[n, k]`` int logical expert ids, ``-1`` = padding.
        weights: ``[n, k]`` float32 gate weights.
        hosted: logical expert id -> weights, for the experts of this layer.
        out: optional ``[n, hidden]`` accumulator (zeroed by the caller).

    Returns:
        ``[n, hidden]``: ``sum_j weights[t, j] * E_{experts[t, j]}(hidden[t])``.

    Raises:
        KeyError: an expert id in ``experts`` is not in ``hosted`` (message names it).
    """
    if out is None:
        out = torch.zeros_like(hidden)
    ids = experts.to(torch.int64)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        if e not in hosted:
            raise KeyError(f"expert {e} is not hosted here")
        tok, slot = torch.nonzero(ids == e, as_tuple=True)  # token rows and their k-slot
        y = expert_forward(hidden[tok], hosted[e])  # (m, H)
        y = y * weights[tok, slot].to(y.dtype).unsqueeze(-1)
        out.index_add_(0, tok, y)
    return out
