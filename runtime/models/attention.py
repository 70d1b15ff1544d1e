"""The attention client's half of the model: everything except the routed experts.

:func:`load_attention_model` loads a Hugging Face MoE CausalLM (DeepSeek-V3, Qwen3-MoE, Mixtral)
and, when given an ``experts_factory``, swaps every MoE layer's *routed-experts* module for a
module of the caller's (the seam the EaaS expert servers plug into). The router/gate (including
DeepSeek-V3's grouped top-k with ``e_score_correction_bias``), the shared experts, attention,
norms, embeddings and ``lm_head`` stay the model's own code.

Where the seam is (transformers 5, all three architectures)::

    # decoder layer l in ModelInfo.moe_layers
    h = x + attn(input_layernorm(x))
    u = post_attention_layernorm(h)                      # (B, S, H)
    # MoE block (DeepseekV3MoE / Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock):
    _, top_k_weights, top_k_index = gate(u)              # (T, k), (T, k); T = B*S
    y = experts(u.view(T, H), top_k_index, top_k_weights)   # <- the replaced module, (T, H)
    y = y + shared_experts(u)                            # DeepSeek-V3 only
    out = h + y.view(B, S, H)

Contract of the module ``experts_factory(layer_idx, info)`` returns (an ``nn.Module``)::

    forward(hidden_states, top_k_index, top_k_weights) -> (T, H)
        hidden_states: (T, H) post-attention-RMSNorm hidden states of all tokens of the batch,
                       flattened over (batch, seq); model dtype.
        top_k_index:   (T, k) int64 logical expert ids in [0, num_experts).
        top_k_weights: (T, k) final gate weights, already normalized and scaled: for DeepSeek-V3
                       sigmoid scores of the chosen experts / their sum * routed_scaling_factor
                       (float32 always); Qwen3-MoE softmax top-k (renormalized iff
                       norm_topk_prob; model dtype); Mixtral softmax top-k renormalized (float32).
        returns:       (T, H) in hidden_states' dtype, equal to the original module's output
                       sum_j top_k_weights[t, j] * E_{top_k_index[t, j]}(hidden_states[t]).

Sources: DeepSeek-V3 technical report (arXiv:2412.19437) section 2.1.2 (routing); transformers 5
``modeling_deepseek_v3.py`` / ``modeling_qwen3_moe.py`` / ``modeling_mixtral.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from eaas.runtime.experts import ExpertWeights, weighted_expert_sum
from eaas.runtime.models.arch import ModelInfo, read_model_info
from eaas.runtime.models.tokenizer import load_tokenizer
from eaas.runtime.models.weights import (
    _Files,
    _read_matrix,
    checkpoint_weight_map,
    load_expert_weights,
)

# transformers is imported inside the function that builds the model: importing it costs
# seconds, which the expert server (it reads weights through this package) never pays.

ExpertsFactory = Callable[[int, ModelInfo], nn.Module]

# on-disk keys of routed experts (any layout): never read by the attention client
_EXPERT_KEY = re.compile(r"^model\.layers\.\d+\.(mlp|block_sparse_moe)\.experts\.")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class LocalExperts(nn.Module):
    """In-process routed experts with the factory contract (baseline and tests).

    The weights are plain attributes, not ``nn.Parameter``s, so they do not show up in
    ``model.parameters()``/``state_dict()``.

    Args:
        hosted: logical expert id -> :class:`ExpertWeights` of this layer (all experts the router
            can pick; a missing one raises ``KeyError`` in forward).
    """

    def __init__(self, hosted: dict[int, ExpertWeights]):
        super().__init__()
        self.hosted = hosted

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return weighted_expert_sum(hidden_states, top_k_index, top_k_weights, self.hosted)  # (T, H)

    def _apply(self, fn, recurse=True):  # model.to(dtype / device) reaches the plain attributes
        self.hosted = {
            e: ExpertWeights(fn(w.gate), fn(w.up), fn(w.down)) for e, w in self.hosted.items()
        }
        return super()._apply(fn, recurse)


def local_experts_factory(
    model_dir: str | Path, dtype: torch.dtype = torch.float32
) -> ExpertsFactory:
    """A factory that loads each layer's experts from ``model_dir`` into a :class:`LocalExperts`."""

    def factory(layer: int, info: ModelInfo) -> nn.Module:
        w = load_expert_weights(
            model_dir, [(layer, e) for e in range(info.num_experts)], dtype=dtype, progress=False
        )
        return LocalExperts({e: w[(layer, e)] for e in range(info.num_experts)})

    return factory


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.model.layers`` of a transformers ``*ForCausalLM`` (the decoder layers)."""
    layers = model.get_submodule("model.layers")
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"model.model.layers is a {type(layers).__name__}, not a ModuleList")
    return layers


def _moe_block(model: nn.Module, layer: int) -> nn.Module:
    mlp = _decoder_layers(model)[layer].get_submodule("mlp")
    if not (hasattr(mlp, "experts") and hasattr(mlp, "gate")):
        raise ValueError(f"layer {layer} is not an MoE layer in this model ({type(mlp).__name__})")
    return mlp


def _check_moe_layers(model: nn.Module, info: ModelInfo) -> None:
    actual = tuple(
        i for i, layer in enumerate(_decoder_layers(model)) if hasattr(layer.mlp, "experts")
    )
    if actual != info.moe_layers:
        raise ValueError(
            f"config.json implies MoE layers {info.moe_layers} but transformers built {actual} "
            "(unsupported layer layout, e.g. DeepSeek moe_layer_freq != 1)"
        )


def load_attention_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    experts_factory: ExpertsFactory | None = None,
    device: str | torch.device = "cpu",
    experts_implementation: str | None = None,
    compute_dtype: torch.dtype | None = None,
):
    """Load the model for an attention client (or the full local model).

    Args:
        model_dir: Hugging Face model directory (``config.json``, safetensors, tokenizer files).
        dtype: dtype of the dense weights (router weight and ``e_score_correction_bias`` stay
            float32, as transformers keeps them).
        experts_factory: ``(layer_idx, info) -> nn.Module`` with the contract in the module
            docstring, called once per MoE layer in ascending order. ``None``: the full local
            model including routed experts (the in-process baseline / reference).
        device: where the model ends up (``model.to(device)``; factory modules are moved too).
        experts_implementation: transformers' routed-experts kernel when ``experts_factory`` is
            None (``"eager"``, ``"grouped_mm"``, ...; None = transformers' default).
        compute_dtype: dtype the forward runs in (None: ``dtype``). ``torch.float32`` with
            ``dtype=torch.bfloat16`` is the CPU ``fp32`` compute policy
            (:mod:`eaas.runtime.models.compute`): the weights are rounded to bfloat16 on load,
            then upcast (exactly) to float32; ``model.eaas_storage_dtype`` is set to ``dtype``
            so the KV cache stays bfloat16 (:func:`storage_dtype`).

    Returns:
        ``(model, tokenizer, info)``: the ``*ForCausalLM`` in eval mode, its tokenizer
        (:func:`~eaas.runtime.models.tokenizer.load_tokenizer`: ``tokenizer.json`` wins), and :class:`ModelInfo`. Callers run it under ``torch.no_grad()``.

    With a factory, the routed experts' tensors are never read from disk nor allocated: the
    model is built on the meta device, the factory modules are installed, every other tensor is
    loaded from the safetensors files, and non-persistent buffers (rotary ``inv_freq``) are
    rebuilt; nothing is left on meta.

    Raises:
        ValueError: unsupported architecture/config, unexpected or missing non-expert tensors.
        TypeError: the factory returned something that is not an ``nn.Module``.
        RuntimeError: a tensor would be left on the meta device.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_dir = Path(model_dir)
    info = read_model_info(model_dir)
    tokenizer = load_tokenizer(model_dir)
    if experts_factory is None:
        kw = (
            {}
            if experts_implementation is None
            else {"experts_implementation": experts_implementation}
        )
        loaded: nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
        _check_moe_layers(loaded, info)
        loaded.to(device).eval()
        return _with_compute_dtype(loaded, dtype, compute_dtype), tokenizer, info

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _check_moe_layers(model, info)

    # 1. install the caller's routed-experts modules (built outside the meta context)
    factory_prefixes = []
    for layer in info.moe_layers:
        block = _moe_block(model, layer)
        mod = experts_factory(layer, info)
        if not isinstance(mod, nn.Module):
            raise TypeError(
                f"experts_factory({layer}) returned {type(mod).__name__}, not an nn.Module"
            )
        block.experts = mod
        factory_prefixes.append(f"model.layers.{layer}.mlp.experts.")

    def is_factory(name: str) -> bool:
        return any(name.startswith(p) for p in factory_prefixes)

    # 2. load every non-expert tensor from disk
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items() if not is_factory(k)}
    wmap = checkpoint_weight_map(model_dir)
    files = _Files(model_dir)
    sd: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    try:
        for key in sorted(wmap):
            if _EXPERT_KEY.match(key) or key.endswith("_scale_inv"):
                continue
            m = _LAYER_KEY.match(key)
            if m and int(m.group(1)) >= info.num_layers:
                continue  # DeepSeek-V3 multi-token-prediction layers (model.layers.61.*)
            name = key.replace(".block_sparse_moe.", ".mlp.")  # Mixtral on-disk naming
            if name not in targets:
                unexpected.append(key)
                continue
            t = _read_matrix(files, wmap, key)
            tgt = targets[name]
            if tuple(t.shape) != tuple(tgt.shape):
                raise ValueError(
                    f"{key}: shape {tuple(t.shape)} on disk, model expects {tuple(tgt.shape)}"
                )
            sd[name] = t.to(tgt.dtype)
    finally:
        files.close()
    if unexpected:
        raise ValueError(f"unexpected tensors in {model_dir}: {unexpected[:10]}")
    model.load_state_dict(sd, strict=False, assign=True)

    # 3. tied embeddings, non-persistent buffers
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in sd:
        model.lm_head.weight = model.get_input_embeddings().weight
    missing = [
        k
        for k in targets
        if k not in sd and not (k == "lm_head.weight" and config.tie_word_embeddings)
    ]
    persistent_missing = [k for k in missing if k in model.state_dict()]
    if persistent_missing:
        raise ValueError(f"tensors missing from {model_dir}: {persistent_missing[:10]}")
    for mname, mod in list(model.named_modules()):
        if is_factory(mname + "."):
            continue
        if any(b is not None and b.is_meta for b in mod._buffers.values()) and type(
            mod
        ).__name__.endswith("RotaryEmbedding"):
            fresh = type(mod)(config=mod.config)
            parent_name, _, child = mname.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, fresh)
    left = [
        n
        for n, t in list(model.named_parameters()) + list(model.named_buffers())
        if t.is_meta and not is_factory(n)
    ]
    if left:
        raise RuntimeError(f"tensors left on the meta device: {left[:10]}")

    gen = model_dir / "generation_config.json"
    if gen.is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.to(device).eval()
    return _with_compute_dtype(model, dtype, compute_dtype), tokenizer, info


def _with_compute_dtype(
    model: nn.Module, dtype: torch.dtype, compute_dtype: torch.dtype | None
) -> nn.Module:
    """Upcast ``model`` (weights already rounded to ``dtype``) to ``compute_dtype``; record the
    storage dtype (KV cache) as ``model.eaas_storage_dtype``."""
    if compute_dtype is not None and compute_dtype != dtype:
        model.to(compute_dtype)  # bf16 -> fp32 is exact: the same weight values
    model.__dict__["eaas_storage_dtype"] = dtype  # a plain attribute, not a module or tensor
    return model


def storage_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model's KV cache is kept in: its ``--dtype`` (``eaas_storage_dtype``, set by
    :func:`load_attention_model`), else the dtype of its first parameter."""
    dt = getattr(model, "eaas_storage_dtype", None)
    return dt if isinstance(dt, torch.dtype) else next(model.parameters()).dtype


__all__ = [
    "load_attention_model",
    "LocalExperts",
    "local_experts_factory",
    "ExpertsFactory",
    "storage_dtype",
]
