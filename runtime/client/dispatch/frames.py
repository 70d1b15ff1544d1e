"""The frames of one MoE layer call: its tensors checked once, then one frame per server.

A frame carries each of its tokens' hidden row once (gathered by the transport straight from
the ``[T, H]`` batch into its send buffer, the only copy) and the token's ``[k]`` expert ids /
weights, in which the pairs assigned to other servers are padded with ``-1`` / ``0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eaas.runtime.transport.base import MAX_K_HARD


def check_call(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, hidden_size: int
) -> None:
    """Validate one MoE layer call's tensors once, before any frame: every frame is then built
    to its shapes (``[n, k]`` expert ids / weights, rows of ``[T, H]`` hidden states) and sent
    with :meth:`~eaas.runtime.transport.base.ClientConnection.send_parts`, which does not
    validate each frame again. A wrong call is the caller's error, never a server marked down.

    Args:
        hidden: ``[T, H]``, ``H == hidden_size``.
        top_k_index: ``[T, k]``.
        top_k_weights: ``[T, k]``.

    Raises:
        ValueError: other shapes, or ``k`` above the frame limit ``MAX_K_HARD`` (``T`` is not
            limited here: a call's tokens are split over servers; a frame above
            ``MAX_TOKENS_HARD`` is refused by the transport).
    """
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden must be [T, {hidden_size}], got {tuple(hidden.shape)}")
    T = hidden.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T:
        raise ValueError(f"top_k_index must be [{T}, k], got {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_weights {tuple(top_k_weights.shape)} must match top_k_index "
            f"{tuple(top_k_index.shape)}"
        )
    if top_k_index.shape[1] > MAX_K_HARD:
        raise ValueError(f"k={top_k_index.shape[1]} exceeds the frame limit {MAX_K_HARD}")


@dataclass(frozen=True)
class ServerFrame:
    """The part of one layer call that goes to one server.

    Attributes:
        experts: ``[n, k]`` int32 expert ids, ``-1`` where the pair is another server's.
        weights: ``[n, k]`` float32 gate weights, ``0`` where the pair is another server's.
        rows: ``[n]`` int64 rows of the call's ``[T, H]`` hidden states, or None when the frame
            has every token (``n == T``: the hidden batch as is).
        n: tokens in the frame (>= 1).
    """

    experts: torch.Tensor
    weights: torch.Tensor
    rows: torch.Tensor | None
    n: int


def server_frame(
    assign: torch.Tensor, si: int, idx32: torch.Tensor, w32: torch.Tensor
) -> ServerFrame | None:
    """The frame of server ``si``: the tokens with at least one pair assigned to it.

    Args:
        assign: ``[T, k]`` int64 server index per pair (``choose_replicas``).
        si: the server's index.
        idx32: ``[T, k]`` int32 expert ids of the call.
        w32: ``[T, k]`` float32 gate weights of the call.

    Returns:
        The :class:`ServerFrame`, or None when no pair of the call is ``si``'s (a server
        reserved with its placement column that this call does not reach).
    """
    m = assign == si  # (T, k)
    nz = m.any(dim=1).nonzero()  # (n, 1)
    n = int(nz.shape[0])
    if n == 0:
        return None
    ex = torch.where(m, idx32, -1)
    w = torch.where(m, w32, 0.0)
    rows: torch.Tensor | None = None  # every token: the hidden batch as is
    if n != int(assign.shape[0]):
        rows = nz.squeeze(1)  # (n,)
        ex, w = ex.index_select(0, rows), w.index_select(0, rows)
    return ServerFrame(ex, w, rows, n)
