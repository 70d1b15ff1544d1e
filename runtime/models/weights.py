"""Read the routed experts an expert server hosts, and nothing else, from a safetensors checkpoint.

On-disk layouts understood (``L`` = layer index, ``E`` = logical expert index):

per-expert, DeepSeek-V3 / Qwen3-MoE (what real checkpoints and transformers 5 ``save_pretrained`` write)::

    model.layers.L.mlp.experts.E.gate_proj.weight   [I, H]
    model.layers.L.mlp.experts.E.up_proj.weight     [I, H]
    model.layers.L.mlp.experts.E.down_proj.weight   [H, I]

per-expert, Mixtral (``w1`` = gate, ``w3`` = up, ``w2`` = down)::

    model.layers.L.block_sparse_moe.experts.E.w1.weight   [I, H]
    model.layers.L.block_sparse_moe.experts.E.w3.weight   [I, H]
    model.layers.L.block_sparse_moe.experts.E.w2.weight   [H, I]

fused (transformers 5 in-memory layout, if written as is; prefix ``mlp`` or ``block_sparse_moe``)::

    model.layers.L.mlp.experts.gate_up_proj   [E_total, 2I, H]   (gate rows, then up rows)
    model.layers.L.mlp.experts.down_proj      [E_total, H, I]

For the fused layout only expert ``E``'s rows are read (``safe_open(...).get_slice(name)[E]``).
FP8 checkpoints (DeepSeek-V3's released weights: ``float8_e4m3fn`` with a per-128x128-block
``<name>_scale_inv``) are dequantized: ``w = w_fp8.float() * scale_inv`` per block.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eaas.runtime.experts import ExpertWeights

# tqdm is imported inside load_expert_weights: only a load with a progress bar needs it.

LayerExpert = tuple[int, int]

_PER_EXPERT = (
    # (prefix inside the layer, gate, up, down)
    ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
    ("block_sparse_moe.experts", "w1", "w3", "w2"),
)
_FUSED_PREFIXES = ("mlp.experts", "block_sparse_moe.experts")
_FP8_BLOCK = 128


def checkpoint_weight_map(model_dir: str | Path) -> dict[str, str]:
    """Tensor name -> safetensors file name (relative to ``model_dir``).

    Uses ``model.safetensors.index.json`` when present, else ``model.safetensors``, else the
    headers of every ``*.safetensors`` file in the directory.

    Raises:
        FileNotFoundError: the directory holds no safetensors weights.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            return dict(json.load(f)["weight_map"])
    files = (
        [d / "model.safetensors"]
        if (d / "model.safetensors").is_file()
        else sorted(d.glob("*.safetensors"))
    )
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {d}")
    out: dict[str, str] = {}
    for p in files:
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():
                out[k] = p.name
    return out


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``w`` ``[R, C]`` fp8, ``scale_inv`` ``[ceil(R/128), ceil(C/128)]`` -> float32 ``[R, C]``."""
    r, c = w.shape
    s = (
        scale_inv.float()
        .repeat_interleave(_FP8_BLOCK, 0)[:r]
        .repeat_interleave(_FP8_BLOCK, 1)[:, :c]
    )
    return w.float() * s


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))


class _Files:
    """Lazily opened ``safe_open`` handles, one per shard, closed by :meth:`close`."""

    def __init__(self, model_dir: Path):
        self.dir = model_dir
        self._open: dict[str, object] = {}
        self._ctx: list[Any] = []

    def get(self, fname: str):
        if fname not in self._open:
            ctx = safe_open(str(self.dir / fname), framework="pt")
            self._open[fname] = ctx.__enter__()
            self._ctx.append(ctx)
        return self._open[fname]

    def close(self) -> None:
        for ctx in self._ctx:
            ctx.__exit__(None, None, None)
        self._open.clear()
        self._ctx.clear()


def _read_matrix(files: _Files, wmap: dict[str, str], name: str) -> torch.Tensor:
    t = files.get(wmap[name]).get_tensor(name)
    if _is_fp8(t):
        sname = name + "_scale_inv"
        if sname not in wmap:
            raise ValueError(f"{name} is fp8 but {sname} is missing from the checkpoint")
        t = _dequant_fp8(t, files.get(wmap[sname]).get_tensor(sname))
    return t


def load_expert_weights(
    model_dir: str | Path,
    pairs: Iterable[LayerExpert],
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> dict[LayerExpert, ExpertWeights]:
    """Load the weights of the given routed experts only.

    Args:
        model_dir: Hugging Face model directory with safetensors weights.
        pairs: ``(layer, logical expert)`` pairs to load (model layer indices, as in
            :attr:`eaas.runtime.models.arch.ModelInfo.moe_layers`). Duplicates are ignored.
        dtype: dtype of the returned tensors (converted on load).
        progress: show a tqdm progress bar (one step per expert).

    Returns:
        ``{(layer, expert): ExpertWeights(gate [I, H], up [I, H], down [H, I])}``, contiguous,
        on CPU, in ``dtype``.

    Raises:
        FileNotFoundError: no safetensors weights in ``model_dir``.
        KeyError: an expert's tensors are in none of the known layouts (message names the pair and
            the key names tried).
    """
    from tqdm.auto import tqdm

    d = Path(model_dir)
    wanted = sorted(set((int(l), int(e)) for l, e in pairs))
    wmap = checkpoint_weight_map(d)
    files = _Files(d)
    out: dict[LayerExpert, ExpertWeights] = {}
    try:
        for layer, expert in tqdm(
            wanted, desc="loading experts", unit="expert", disable=not progress
        ):
            out[(layer, expert)] = _load_one(files, wmap, layer, expert, dtype)
    finally:
        files.close()
    return out


def _load_one(
    files: _Files, wmap: dict[str, str], layer: int, expert: int, dtype: torch.dtype
) -> ExpertWeights:
    base = f"model.layers.{layer}."
    tried: list[str] = []
    for prefix, g, u, dn in _PER_EXPERT:
        names = [f"{base}{prefix}.{expert}.{p}.weight" for p in (g, u, dn)]
        if all(n in wmap for n in names):
            gate, up, down = (_read_matrix(files, wmap, n).to(dtype).contiguous() for n in names)
            return ExpertWeights(gate=gate, up=up, down=down)
        tried.append(names[0])
    for prefix in _FUSED_PREFIXES:
        gu, dn = f"{base}{prefix}.gate_up_proj", f"{base}{prefix}.down_proj"
        if gu in wmap and dn in wmap:
            gu_sl = files.get(wmap[gu]).get_slice(gu)
            dn_sl = files.get(wmap[dn]).get_slice(dn)
            n_exp = gu_sl.get_shape()[0]
            if not 0 <= expert < n_exp:
                raise KeyError(f"expert {expert} out of range: {gu} holds {n_exp} experts")
            gate_up = gu_sl[expert]  # (2I, H): only this expert's bytes are read
            down = dn_sl[expert]  # (H, I)
            if _is_fp8(gate_up) or _is_fp8(down):
                raise ValueError(f"{gu}: fused fp8 expert tensors are not supported")
            inter = gate_up.shape[0] // 2
            return ExpertWeights(
                gate=gate_up[:inter].to(dtype).contiguous(),
                up=gate_up[inter:].to(dtype).contiguous(),
                down=down.to(dtype).contiguous(),
            )
        tried.append(gu)
    raise KeyError(
        f"expert (layer {layer}, expert {expert}) not found in the checkpoint; tried {tried}"
    )


def group_by_layer(
    weights: dict[LayerExpert, ExpertWeights],
) -> dict[int, dict[int, ExpertWeights]]:
    """``{(l, e): w}`` -> ``{l: {e: w}}`` (the ``hosted`` argument of ``weighted_expert_sum``)."""
    out: dict[int, dict[int, ExpertWeights]] = defaultdict(dict)
    for (l, e), w in weights.items():
        out[l][e] = w
    return dict(out)


def expert_nbytes(hidden: int, intermediate: int, dtype: torch.dtype) -> int:
    """Bytes one expert occupies in ``dtype``: ``3 * H * I * itemsize``."""
    return 3 * hidden * intermediate * torch.empty((), dtype=dtype).element_size()


__all__ = [
    "load_expert_weights",
    "checkpoint_weight_map",
    "group_by_layer",
    "expert_nbytes",
    "LayerExpert",
]
