"""What an expert server hosts: one layer's experts stacked for ``grouped_mm`` and the
copy-on-write snapshot of every hosted ``(layer, logical expert)`` pair.

:class:`LayerStack` (CPU weights) stacks a layer's hosted experts so the expert compute
(:mod:`eaas.runtime.server.compute`) runs them as two ``grouped_mm`` calls; :class:`Hosting`
is one immutable snapshot of the hosted experts, swapped whole when experts are added or
dropped while serving (:meth:`eaas.runtime.server.server.ExpertServer.add_experts`), so each
dynamic batch runs on one consistent snapshot.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eaas.runtime.experts import ExpertWeights


@dataclass(frozen=True)
class LayerStack:
    """One layer's hosted experts stacked for ``torch.nn.functional.grouped_mm`` (CPU).

    Each hosted :class:`ExpertWeights` of the layer is rebound to views of these tensors
    (:meth:`build`), so the stack costs no second copy of the weights.

    Attributes:
        gate_up: ``[G, 2I, H]``: hosted expert ``g``'s gate rows then up rows.
        down: ``[G, H, I]``.
        experts: ``{expert id: ExpertWeights}`` whose tensors are views of the stack.
        ids: the hosted expert ids in group order (ascending).
        group_of: ``[max hosted id + 2]`` int64: ``group_of[id + 1]`` is ``id``'s group; the
            padding id ``-1`` and ids not hosted map to ``G`` (a last group that is never run).
        gate_up_t: ``gate_up.transpose(1, 2)``, ``[G, H, 2I]`` (the ``grouped_mm`` operand).
        down_t: ``down.transpose(1, 2)``, ``[G, I, H]``.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    experts: Mapping[int, ExpertWeights]
    ids: tuple[int, ...]
    group_of: torch.Tensor
    gate_up_t: torch.Tensor
    down_t: torch.Tensor

    @classmethod
    def build(cls, experts: Mapping[int, ExpertWeights]) -> LayerStack:
        """Stack ``experts`` (``{expert id: ExpertWeights}``, at least one; gate/up ``[I, H]``,
        down ``[H, I]``, one dtype and device) in ascending id order. Raises IndexError when
        ``experts`` is empty."""
        ids = sorted(experts)
        n = int(experts[ids[0]].gate.shape[0])  # I
        gate_up = torch.stack([torch.cat([experts[e].gate, experts[e].up]) for e in ids])
        down = torch.stack([experts[e].down for e in ids])  # (G, H, I)
        group_of = torch.full((ids[-1] + 2,), len(ids), dtype=torch.int64)
        group_of[torch.tensor(ids) + 1] = torch.arange(len(ids))
        views = {
            e: ExpertWeights(gate_up[g, :n], gate_up[g, n:], down[g]) for g, e in enumerate(ids)
        }
        return cls(
            gate_up,
            down,
            views,
            tuple(ids),
            group_of,
            gate_up.transpose(1, 2),
            down.transpose(1, 2),
        )

    @functools.cached_property
    def usable(self) -> bool:
        """Whether this torch's ``grouped_mm`` takes this stack on the CPU (one row through
        both projections, tried once). It does not for every dtype and shape: torch 2.15 wants
        each row's bytes a multiple of 16 ("strides should be multiple of 16 bytes": bf16
        hidden / intermediate sizes not a multiple of 8, fp32 not of 4), and older versions
        have no CPU kernel."""
        n_i = int(self.down.shape[2])
        x = torch.zeros(1, int(self.down.shape[1]), dtype=self.down.dtype)  # (1, H)
        offs = torch.ones(int(self.gate_up.shape[0]), dtype=torch.int32)  # the row in group 0
        try:
            gu = F.grouped_mm(x, self.gate_up_t, offs=offs)  # (1, 2I)
            y = F.grouped_mm(F.silu(gu[:, :n_i]), self.down_t, offs=offs)
        except (AttributeError, RuntimeError, TypeError, NotImplementedError):
            return False
        return tuple(y.shape) == tuple(x.shape)


@dataclass(frozen=True)
class Hosting:
    """One immutable snapshot of what a server hosts (swapped whole on add/drop).

    Attributes:
        pairs: ``{(layer, expert): ExpertWeights}``.
        by_layer: layer -> expert id -> weights.
        accept: layer -> ``[max hosted id + 2]`` bool, ``accept[id + 1]``: ``id`` may appear in
            a frame (hosted, or the padding id ``-1``): the check of a good frame in one lookup;
            ``accept[1:]`` is the layer's hosted mask (frame checks without Python per id).
        stacks: layer -> :class:`LayerStack` (CPU weights: ``pairs`` and ``by_layer`` hold
            views of it); empty on CUDA.
        gpu: layer -> lazily built native grouped kernel of THIS snapshot (CUDA weights only).
        fused: layer -> :class:`~eaas.runtime.server.cpu_fused.FusedLayer` of THIS snapshot's
            stack, or False where vLLM's kernel cannot take it; filled by the server right after
            :meth:`build` with ``--cpu-kernel vllm`` (empty otherwise).
    """

    pairs: Mapping[tuple[int, int], ExpertWeights]
    by_layer: Mapping[int, Mapping[int, ExpertWeights]]
    accept: Mapping[int, torch.Tensor]
    stacks: Mapping[int, LayerStack] = field(default_factory=dict)
    gpu: dict[int, object] = field(default_factory=dict)
    fused: dict[int, object] = field(default_factory=dict)

    @classmethod
    def build(
        cls, pairs: Mapping[tuple[int, int], ExpertWeights], device: torch.device | None
    ) -> Hosting:
        """The snapshot of ``pairs`` (``{(layer, expert): ExpertWeights}``) whose weights live on
        ``device`` (None: the CPU). On the CPU, with a ``grouped_mm`` that takes every layer's
        stack, the weights are rebound to views of one :class:`LayerStack` per layer."""
        by_layer: dict[int, dict[int, ExpertWeights]] = {}
        for (layer, e), w in pairs.items():
            by_layer.setdefault(layer, {})[e] = w
        accept = {}
        for layer, experts in by_layer.items():
            a = torch.zeros(max(experts) + 2, dtype=torch.bool)
            a[0] = True  # the padding id -1
            a[[e + 1 for e in experts]] = True
            accept[layer] = a
        stacks: dict[int, LayerStack] = {}
        if (device is None or device.type == "cpu") and hasattr(F, "grouped_mm"):
            # one stack per layer, the weights rebound to views of it (no second copy: the
            # previous snapshot's tensors go when its last batch is done)
            stacks = {layer: LayerStack.build(experts) for layer, experts in by_layer.items()}
            if all(st.usable for st in stacks.values()):
                by_layer = {layer: dict(st.experts) for layer, st in stacks.items()}
                pairs = {(layer, e): w for layer, ex in by_layer.items() for e, w in ex.items()}
            else:  # this torch's CPU grouped_mm refuses these dtypes / shapes: the loop
                stacks = {}
        return cls(dict(pairs), by_layer, accept, stacks)
