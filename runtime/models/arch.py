"""Architecture facts EaaS needs about a checkpoint, read from its ``config.json``.

Supported Hugging Face architectures (``config.json`` ``architectures[0]``):

``DeepseekV3ForCausalLM`` (primary)
    MoE layers are ``l >= first_k_dense_replace`` with ``l % moe_layer_freq == 0`` (the formula of
    DeepSeek's reference ``modeling_deepseek.py``; real checkpoints have ``moe_layer_freq == 1``).
    Routed experts: ``n_routed_experts``; top-k: ``num_experts_per_tok``. Source: DeepSeek-V3
    technical report, arXiv:2412.19437 section 2.1.2.
``Qwen3MoeForCausalLM``
    MoE layers are ``l not in mlp_only_layers`` with ``(l + 1) % decoder_sparse_step == 0``
    (transformers' ``Qwen3MoeDecoderLayer``). Experts: ``num_experts`` (transformers 5 writes
    ``num_local_experts``; both accepted).
``MixtralForCausalLM``
    Every layer is an MoE layer. Experts: ``num_local_experts``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eaas.runtime.common.dtypes import DTYPE_ALIASES, torch_dtype

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class ModelInfo:
    """What the runtime needs to know about an MoE checkpoint.

    Attributes:
        architecture: ``architectures[0]`` of ``config.json``, e.g. ``"DeepseekV3ForCausalLM"``.
        model_type: ``model_type`` of ``config.json``, e.g. ``"deepseek_v3"``.
        hidden_size: ``H``, width of the hidden states sent to expert servers.
        num_layers: decoder layers (``num_hidden_layers``; DeepSeek's MTP layers not counted).
        moe_layers: ascending indices of the decoder layers whose MLP is a routed-MoE block.
        num_experts: routed (logical) experts per MoE layer.
        top_k: experts selected per token.
        moe_intermediate_size: ``I`` of one routed expert (gate/up are ``[I, H]``, down ``[H, I]``).
        vocab_size: rows of the embedding / lm_head.
        max_position_embeddings: longest sequence the model supports.
        torch_dtype: dtype the checkpoint declares (``dtype``/``torch_dtype``), float32 if absent.
    """

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: torch.dtype


def _req(cfg: dict, key: str, path: Path) -> object:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{path}: config field {key!r} is missing")
    return cfg[key]


def _req_int(cfg: dict, key: str, path: Path, minimum: int = 0) -> int:
    v = _req(cfg, key, path)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{path}: config field {key!r} must be an int >= {minimum}, got {v!r}")
    return v


def _req_int_any(cfg: dict, keys: tuple[str, ...], path: Path, minimum: int = 0) -> int:
    """First of ``keys`` present (aliases: real checkpoints vs transformers 5 ``save_pretrained``)."""
    for k in keys:
        if cfg.get(k) is not None:
            return _req_int(cfg, k, path, minimum)
    raise ValueError(f"{path}: config field {keys[0]!r} is missing (also tried {list(keys[1:])})")


def _dtype(cfg: dict, path: Path) -> torch.dtype:
    name = cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    if isinstance(name, str):
        name = name.removeprefix("torch.")
    if name not in DTYPE_ALIASES:
        raise ValueError(f"{path}: config field 'dtype' has unsupported value {name!r}")
    return torch_dtype(name)


def model_info_from_config(cfg: dict, path: Path | str = "config.json") -> ModelInfo:
    """Build a :class:`ModelInfo` from a parsed ``config.json`` dict.

    Raises:
        ValueError: unsupported architecture, or a required field is missing/invalid (the message
            names the field).
    """
    path = Path(path)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{path}: config field 'architectures' is missing or empty")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    n_layers = _req_int(cfg, "num_hidden_layers", path, 1)
    if arch == "DeepseekV3ForCausalLM":
        num_experts = _req_int_any(cfg, ("n_routed_experts", "num_local_experts"), path, 1)
        first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
        freq = int(cfg.get("moe_layer_freq", 1) or 1)
        if first_dense < 0:
            raise ValueError(f"{path}: config field 'first_k_dense_replace' must be >= 0")
        if freq < 1:
            raise ValueError(f"{path}: config field 'moe_layer_freq' must be >= 1")
        moe = tuple(l for l in range(n_layers) if l >= first_dense and l % freq == 0)
    elif arch == "Qwen3MoeForCausalLM":
        num_experts = _req_int_any(cfg, ("num_experts", "num_local_experts"), path, 1)
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        if step < 1:
            raise ValueError(f"{path}: config field 'decoder_sparse_step' must be >= 1")
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        moe = tuple(l for l in range(n_layers) if l not in mlp_only and (l + 1) % step == 0)
    else:  # MixtralForCausalLM
        num_experts = _req_int_any(cfg, ("num_local_experts", "num_experts"), path, 1)
        moe = tuple(range(n_layers))
    if arch == "MixtralForCausalLM":
        inter = _req_int(cfg, "intermediate_size", path, 1)
    else:
        inter = _req_int(cfg, "moe_intermediate_size", path, 1)
    top_k = _req_int(cfg, "num_experts_per_tok", path, 1)
    if top_k > num_experts:
        raise ValueError(
            f"{path}: config field 'num_experts_per_tok' ({top_k}) exceeds the expert count ({num_experts})"
        )
    return ModelInfo(
        architecture=arch,
        model_type=str(_req(cfg, "model_type", path)),
        hidden_size=_req_int(cfg, "hidden_size", path, 1),
        num_layers=n_layers,
        moe_layers=moe,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=inter,
        vocab_size=_req_int(cfg, "vocab_size", path, 1),
        max_position_embeddings=_req_int(cfg, "max_position_embeddings", path, 1),
        torch_dtype=_dtype(cfg, path),
    )


def read_model_info(model_dir: str | Path) -> ModelInfo:
    """Read ``model_dir/config.json`` into a :class:`ModelInfo`.

    Raises:
        FileNotFoundError: no ``config.json`` in ``model_dir``.
        ValueError: unsupported architecture or a missing/invalid field (message names it).
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found (is {model_dir} a Hugging Face model directory?)"
        )
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    return model_info_from_config(cfg, path)
