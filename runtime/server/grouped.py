"""Grouped SwiGLU expert GEMM with kernel shrinking (one launch sequence per MoE layer call).

The expert server's CUDA path (``native/eaas_experts.cu``); the CPU path and the numerical
reference stay :func:`eaas.runtime.server.compute.grouped_expert_sum`.

Kernel shrinking (EaaS paper, arXiv:2509.17863, "kernel shrinking"; 14.9% of throughput in its
ablation): the group metadata handed to the GEMM lists only the hosted experts that received
tokens (and, per active expert, ``ceil(count / BM)`` row tiles); blocks past the device-side tile
count return at once. Token counts are computed and read **on the device**, and every grid size
depends only on ``n_pairs = N * k`` (the batch bucket) and ``E`` (hosted experts), so the whole
layer call can be captured in a CUDA graph and replayed for any routing.

:func:`compact_groups` is the pure CPU mirror of the ``eaas_moe_route`` kernel (same outputs;
rows inside one expert's group may come in another order on the GPU, which changes no number
because rows are independent) and :func:`grouped_swiglu_reference` runs the kernels' algorithm
on the CPU, so the metadata logic is tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaas.runtime.cuda.nvrtc import load_module
from eaas.runtime.experts import ExpertWeights

BM = 32  # rows per tile: EAAS_BM in native/eaas_experts.cu
BN = 32  # output columns per tile: EAAS_BN
ROUTE_THREADS = 1024


def max_tiles(n_pairs: int, num_local: int) -> int:
    """Fixed grid.x of the GEMM launches: an upper bound of ``sum_e ceil(count_e / BM)`` over
    any routing of ``n_pairs`` pairs to ``num_local`` experts (``n_pairs / BM + experts with
    tokens``)."""
    return n_pairs // BM + min(num_local, n_pairs) + 1


@dataclass
class GroupMeta:
    """Compact group metadata of one layer call (what ``eaas_moe_route`` writes).

    Attributes:
        counts: ``[E]`` int32 tokens per hosted expert slot.
        offsets: ``[E + 1]`` int32 first row of each slot's group in the grouped buffer.
        active: ``[num_active]`` int32 hosted slots with tokens, ascending.
        tile_expert, tile_row0: ``[num_tiles]`` int32 slot and first row of each row tile.
        pos: ``[N * k]`` int32 row of each (token, k-slot) pair, ``-1`` for padding.
        row_pair: ``[rows]`` int32 pair index of each row (token = pair // k).
        not_hosted: a non-negative expert id had no hosted slot (the pair is skipped).
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    active: torch.Tensor
    tile_expert: torch.Tensor
    tile_row0: torch.Tensor
    pos: torch.Tensor
    row_pair: torch.Tensor
    not_hosted: bool

    @property
    def num_tiles(self) -> int:
        return int(self.tile_expert.numel())


def compact_groups(experts: torch.Tensor, local_of: torch.Tensor, num_local: int) -> GroupMeta:
    """CPU mirror of ``eaas_moe_route``: group the token-expert pairs by hosted expert.

    Args:
        experts: ``[N, k]`` int logical expert ids, ``-1`` = padding.
        local_of: ``[L]`` int32 logical id -> hosted slot ``0..E-1`` or ``-1``.
        num_local: ``E``.

    Returns:
        :class:`GroupMeta`; only experts with tokens get tiles (kernel shrinking).
    """
    flat = experts.reshape(-1).to(torch.int64)
    n_pairs = int(flat.numel())
    in_range = (flat >= 0) & (flat < local_of.numel())
    slot = torch.full_like(flat, -1)
    slot[in_range] = local_of.to(torch.int64)[flat[in_range]]
    not_hosted = bool(((flat >= 0) & (slot < 0)).any())
    counts = torch.bincount(slot[slot >= 0], minlength=num_local)[:num_local]
    offsets = torch.zeros(num_local + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    active = torch.nonzero(counts > 0).flatten()
    tiles = [
        (l, int(offsets[l]) + r) for l in active.tolist() for r in range(0, int(counts[l]), BM)
    ]
    assert len(tiles) <= max_tiles(n_pairs, num_local)
    valid = torch.nonzero(slot >= 0).flatten()
    order = valid[torch.argsort(slot[valid], stable=True)]  # pairs grouped by slot
    pos = torch.full((n_pairs,), -1, dtype=torch.int64)
    pos[order] = torch.arange(order.numel())
    i32 = torch.int32
    return GroupMeta(
        counts=counts.to(i32),
        offsets=offsets.to(i32),
        active=active.to(i32),
        tile_expert=torch.tensor([t[0] for t in tiles], dtype=i32),
        tile_row0=torch.tensor([t[1] for t in tiles], dtype=i32),
        pos=pos.to(i32),
        row_pair=order.to(i32),
        not_hosted=not_hosted,
    )


def stack_weights(
    hosted: Mapping[int, ExpertWeights],
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Hosted experts of one layer as the kernels' stacked weights.

    Returns:
        ``(ids, w_gate_up [E, 2I, H], w_down [E, H, I])``; slot ``l`` holds expert ``ids[l]``
        (ascending ids), same dtype/device as the inputs.
    """
    ids = sorted(int(e) for e in hosted)
    if not ids:
        raise ValueError("no hosted experts to stack")
    gu = torch.stack([hosted[e].gate_up for e in ids]).contiguous()  # (E, 2I, H)
    dn = torch.stack([hosted[e].down for e in ids]).contiguous()  # (E, H, I)
    return ids, gu, dn


def grouped_swiglu_reference(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    local_of: torch.Tensor,
) -> tuple[torch.Tensor, GroupMeta]:
    """The kernels' algorithm on the CPU: route, tile-wise grouped GEMMs, fp32 combine.

    Args:
        hidden: ``[N, H]``; experts/weights ``[N, k]``; w_gate_up ``[E, 2I, H]``;
            w_down ``[E, H, I]``; local_of ``[L]``.

    Returns:
        ``(out [N, H] in hidden's dtype, meta)``. Raises KeyError when an expert is not hosted.
    """
    n, k = experts.shape
    E, two_i, H = w_gate_up.shape
    inter = two_i // 2
    meta = compact_groups(experts, local_of, E)
    if meta.not_hosted:
        raise KeyError("an expert in the frame is not hosted here")
    rows = int(meta.offsets[-1])
    act = torch.zeros(rows, inter)  # (rows, I) fp32
    y = torch.zeros(rows, H)  # (rows, H) fp32
    for l, r0 in zip(meta.tile_expert.tolist(), meta.tile_row0.tolist(), strict=True):
        r1 = min(r0 + BM, int(meta.offsets[l + 1]))
        tok = meta.row_pair[r0:r1].long() // k
        x = hidden[tok].float()  # (m, H)
        gu = x @ w_gate_up[l].float().T  # (m, 2I)
        act[r0:r1] = F.silu(gu[:, :inter]) * gu[:, inter:]
        y[r0:r1] = act[r0:r1] @ w_down[l].float().T  # (m, H)
    out = torch.zeros(n, H)
    pos = meta.pos.long().view(n, k)
    w = weights.float().view(n, k)
    for j in range(k):
        ok = pos[:, j] >= 0
        out[ok] += w[ok, j : j + 1] * y[pos[ok, j]]
    return out.to(hidden.dtype), meta


class GroupedExperts:
    """One layer's hosted experts on a CUDA device, run by the native grouped kernels.

    Args:
        hosted: logical expert id -> weights (all on one CUDA device, float32 or bfloat16).
        num_logical: number of logical experts of the layer (size of the id -> slot table);
            default ``max(id) + 1``.

    Call with ``(hidden [N, H], experts [N, k] int, weights [N, k] float)`` on the same device;
    returns ``(out [N, H], loads {expert id: tokens})``. Launches go on torch's current stream
    with grid sizes fixed by ``(N * k, E)``: capturable in a CUDA graph (use
    :meth:`forward_async` there, which skips the host read of the loads).

    Raises:
        GpuUnavailableError: no GPU / cuda-python (at construction).
        ValueError: weights not on CUDA, mixed dtypes.
    """

    def __init__(self, hosted: Mapping[int, ExpertWeights], num_logical: int | None = None):
        self.ids, self.w_gate_up, self.w_down = stack_weights(hosted)
        if not self.w_gate_up.is_cuda:
            raise ValueError("GroupedExperts needs the weights on a CUDA device")
        if self.w_gate_up.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"unsupported weight dtype {self.w_gate_up.dtype}")
        self.device = self.w_gate_up.device
        self.dtype = self.w_gate_up.dtype
        self.num_local, two_i, self.hidden_size = self.w_gate_up.shape
        self.inter = two_i // 2
        L = num_logical if num_logical is not None else max(self.ids) + 1
        local_of = torch.full((L,), -1, dtype=torch.int32)
        local_of[torch.tensor(self.ids)] = torch.arange(len(self.ids), dtype=torch.int32)
        self.local_of = local_of.to(self.device)
        self.suffix = "f32" if self.dtype == torch.float32 else "bf16"
        self.mod = load_module("eaas_experts.cu", self.device)
        self._scratch: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def scratch(self, n: int, k: int) -> dict[str, torch.Tensor]:
        """Device buffers for a bucket of ``n`` tokens x ``k`` (kept: graph replays reuse them)."""
        key = (n, k)
        s = self._scratch.get(key)
        if s is None:
            E, P, dev = self.num_local, n * k, self.device
            mt = max_tiles(P, E)

            def i32(size: int) -> torch.Tensor:
                return torch.empty(size, dtype=torch.int32, device=dev)

            s = {
                "counts": i32(E),
                "offsets": i32(E + 1),
                "cursor": i32(E),
                "active": i32(E),
                "tile_expert": i32(mt),
                "tile_row0": i32(mt),
                "pos": i32(max(P, 1)),
                "row_pair": i32(max(P, 1)),
                "meta": torch.zeros(4, dtype=torch.int32, device=dev),
                "act": torch.empty(max(P, 1), self.inter, dtype=torch.float32, device=dev),
                "y": torch.empty(max(P, 1), self.hidden_size, dtype=torch.float32, device=dev),
            }
            self._scratch[key] = s
        return s

    def forward_async(
        self,
        hidden: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Enqueue the four launches; no host synchronisation (graph-capturable).

        Returns ``(out [N, H], scratch)``; ``scratch["counts"]`` holds the loads and
        ``scratch["meta"][3]`` is 1 when an expert id was not hosted (those pairs are skipped).
        """
        n, k = int(experts.shape[0]), int(experts.shape[1]) if experts.dim() == 2 else 1
        H, I, E = self.hidden_size, self.inter, self.num_local
        if out is None:
            out = torch.empty(n, H, dtype=self.dtype, device=self.device)
        s = self.scratch(n, k)
        if n == 0:
            return out, s
        ex = experts.reshape(-1).to(torch.int32).contiguous()
        w = weights.reshape(-1).to(torch.float32).contiguous()
        x = hidden.contiguous()
        P = n * k
        mt = max_tiles(P, E)
        m = self.mod
        m.launch(
            "eaas_moe_route",
            (1,),
            (ROUTE_THREADS,),
            [ex, P, self.local_of, int(self.local_of.numel()), E, mt, s["counts"], s["offsets"],
             s["cursor"], s["active"], s["tile_expert"], s["tile_row0"], s["pos"],
             s["row_pair"], s["meta"]],
        )  # fmt: skip
        m.launch(
            f"eaas_grouped_gate_up_{self.suffix}",
            (mt, (I + BN - 1) // BN),
            (32, 8),
            [x, self.w_gate_up, s["offsets"], s["row_pair"], s["tile_expert"], s["tile_row0"],
             s["meta"], k, H, I, s["act"]],
        )  # fmt: skip
        m.launch(
            f"eaas_grouped_down_{self.suffix}",
            (mt, (H + BN - 1) // BN),
            (32, 8),
            [s["act"], self.w_down, s["offsets"], s["tile_expert"], s["tile_row0"], s["meta"],
             H, I, s["y"]],
        )  # fmt: skip
        m.launch(f"eaas_combine_{self.suffix}", (n,), (256,), [s["y"], s["pos"], w, k, H, out])
        return out, s

    def __call__(
        self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """Run the layer call and read the loads (one device->host sync).

        Raises:
            KeyError: an expert id is not hosted here.
        """
        out, s = self.forward_async(hidden, experts, weights)
        if int(experts.shape[0]) == 0:
            return out, {}
        counts = s["counts"].tolist()
        if int(s["meta"][3]):
            raise KeyError("an expert in the frame is not hosted here")
        return out, {self.ids[l]: c for l, c in enumerate(counts) if c}
