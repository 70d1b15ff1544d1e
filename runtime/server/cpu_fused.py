"""vLLM's CPU fused-MoE kernel as an expert server's CPU expert compute (``--cpu-kernel``).

Why: torch's CPU ``grouped_mm`` runs one ``aten::mm`` per expert group, and each small matmul
costs 15-35 us of library overhead whatever its size. At decode batch sizes a server call is a
few rows per expert, so that overhead is the call: at the tiny model's shapes (hidden 256,
``moe_intermediate`` 128, 16 hosted experts, 16 tokens) ``grouped_expert_sum`` took ~1 ms in
bfloat16 where vLLM's ``cpu_fused_moe`` (one C++ kernel over all groups, weights repacked at
load; SGLang's CPU MoE kernel in vLLM's CPU build) took ~0.2 ms (``bench/expert_kernel.py``).
A server whose Python has vLLM's CPU build (``eaas serve --engine vllm`` starts its servers with
the vllm command's Python; an image with vLLM) therefore runs that kernel; every other server
keeps :mod:`eaas.runtime.server.compute`.

The kernel library is loaded without importing vLLM (2-3 s): the same ``_C`` shared object vLLM
0.32's ``CpuPlatform.import_kernels`` picks for this CPU (``_C`` with AVX-512 BF16, ``_C_AVX512``
with AVX-512, else ``_C_AVX2``), through ``torch.ops.load_library``; its ops are
``torch.ops._C.prepack_moe_weight`` and ``torch.ops._C.cpu_fused_moe`` (signatures of
``vllm._custom_ops.cpu_prepack_moe_weight`` / ``cpu_fused_moe``). ISA ``amx`` for bfloat16 on
a CPU with AMX tiles, else ``vec`` (vLLM's ``X86CPUUnquantizedExperts`` /
``CPUUnquantizedExperts``); hidden and intermediate sizes must be multiples of 32 (vLLM pads
the intermediate size; here such a layer keeps the torch path).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from eaas.runtime.server.hosting import LayerStack

ALIGN = 32  # hidden and intermediate sizes: multiples of this (vLLM's output_alignment)


@functools.cache
def load_kernel() -> tuple[bool, str]:
    """``(loaded, why)``: whether vLLM's CPU MoE ops are in ``torch.ops._C`` now (loading vLLM's
    kernel library once, see the module docstring), and else why not (no vLLM in this Python,
    a library built for another torch, ...). Never raises."""
    if hasattr(torch.ops._C, "cpu_fused_moe"):
        return True, "loaded"
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return False, "no vllm in this Python"  # (origin None: a namespace folder named vllm)
    cpu = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX512_BF16"?, "AVX2", ...
    if torch.cpu._is_avx512_supported():
        name = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        name = "_C_AVX2"
    path = os.path.join(spec.submodule_search_locations[0], f"{name}.abi3.so")
    if not os.path.exists(path):
        return False, f"vllm has no {name}.abi3.so (not vLLM's CPU build; CPU {cpu})"
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as exc:
        return False, f"{path}: {exc}".splitlines()[0]
    if not hasattr(torch.ops._C, "cpu_fused_moe"):
        return False, f"{path} has no cpu_fused_moe"
    return True, "loaded"


def isa_for(dtype: torch.dtype) -> str:
    """The kernel ISA for ``dtype``: ``amx`` for bfloat16 on a CPU with AMX tiles, else ``vec``."""
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    return "amx" if dtype == torch.bfloat16 and amx else "vec"


def unsupported(stack: LayerStack) -> str | None:
    """Why the kernel cannot run ``stack`` (dtype, shape), or None."""
    dt = stack.gate_up.dtype
    if dt not in (torch.float32, torch.bfloat16):
        return f"dtype {dt}"
    h, i = int(stack.down.shape[1]), int(stack.down.shape[2])
    if h % ALIGN or i % ALIGN:
        return f"hidden {h} / intermediate {i} not multiples of {ALIGN}"
    return None


@dataclass(frozen=True)
class FusedLayer:
    """One layer's hosted experts repacked for ``cpu_fused_moe`` (a copy: the prepacked layout
    is the kernel's own; the :class:`LayerStack` stays for add/drop snapshots).

    Attributes:
        w13: prepacked ``[G, 2I, H]`` (gate rows then up rows, the stack's ``gate_up``).
        w2: prepacked ``[G, H, I]``.
        local_of: ``[max hosted id + 2]`` int32: ``local_of[id + 1]`` is ``id``'s group; the
            padding id ``-1`` (and an id not hosted) maps to ``G``.
        ids: the hosted expert ids in group order.
        isa: the kernel ISA.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    local_of: torch.Tensor
    ids: tuple[int, ...]
    isa: str

    @classmethod
    def build(cls, stack: LayerStack) -> FusedLayer:
        """Prepack ``stack`` (loading the kernel library first; check :func:`unsupported`).

        Raises:
            RuntimeError: vLLM's kernel does not load in this Python (the reason).
        """
        loaded, why = load_kernel()
        if not loaded:
            raise RuntimeError(f"vLLM's CPU MoE kernel does not load here: {why}")
        isa = isa_for(stack.gate_up.dtype)
        packed = []
        for w in (stack.gate_up, stack.down):
            out = torch.empty_like(w)
            torch.ops._C.prepack_moe_weight(w.contiguous(), out, isa)
            packed.append(out)
        return cls(packed[0], packed[1], stack.group_of.to(torch.int32), stack.ids, isa)

    def __call__(
        self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, dict[int, int]]:
        """:func:`~eaas.runtime.server.compute.grouped_expert_sum` on this layer: ``hidden``
        ``[N, H]`` (the weights' dtype), ``experts`` ``[N, k]`` int logical ids (``-1``:
        padding), ``weights`` ``[N, k]`` float32 -> ``(out [N, H], {expert id: pairs})``.

        Without padding the kernel takes the frame as it is. With padding (the ids of a frame
        that this server does not host are ``-1``), each real pair becomes a row of its own
        (``[P, H]`` gathered, ``k`` 1), and the weighted rows are summed per token in float32
        and rounded once: the kernel takes ``k`` experts for every row, so padding would cost
        as much as a real pair.
        """
        n, k = experts.shape
        if n == 0 or k == 0:
            return torch.zeros_like(hidden), {}
        g = len(self.ids)
        local = self.local_of.index_select(0, experts.reshape(-1).to(torch.int64) + 1)
        counts = torch.bincount(local, minlength=g + 1).tolist()  # (G+1,) last: padding
        loads = {e: c for e, c in zip(self.ids, counts[:g], strict=True) if c}
        w = weights.to(torch.float32).reshape(-1)
        if not counts[g]:
            return self._run(hidden.contiguous(), local.view(n, k), w.view(n, k)), loads
        pos = (local != g).nonzero().squeeze(1)  # (P,) flat positions of real pairs
        if pos.numel() == 0:
            return torch.zeros_like(hidden), {}
        tok = torch.div(pos, k, rounding_mode="floor")  # (P,)
        ys = self._run(
            hidden.index_select(0, tok),
            local.index_select(0, pos).unsqueeze(1),
            w.index_select(0, pos).unsqueeze(1),
        )  # (P, H) weighted
        out32 = torch.zeros((n, hidden.shape[1]), dtype=torch.float32)
        out32.index_add_(0, tok, ys.float() if ys.dtype != torch.float32 else ys)
        return (out32 if hidden.dtype == torch.float32 else out32.to(hidden.dtype)), loads

    def _run(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``cpu_fused_moe`` on ``x`` ``[M, H]``, local ids ``[M, k]`` int32, weights ``[M, k]``
        float32 -> ``[M, H]`` (weighted sum over the row's ``k`` experts)."""
        out = torch.empty_like(x)
        torch.ops._C.cpu_fused_moe(
            out, x, self.w13, self.w2, None, None, w, ids, False, "silu", self.isa
        )
        return out
