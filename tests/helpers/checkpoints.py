"""Tiny Qwen3-MoE and Mixtral checkpoints for the model, engine and GPU-overlap tests (random
weights, saved by transformers; fixed seeds, so the same call writes the same weights).

GQA with 2 KV heads for 4 query heads, an MLP-only first layer for Qwen3-MoE; the tiny
DeepSeek-V3 model's tokenizer files are copied in from ``tokenizer_from``. The session fixture
``checkpoints`` (tests/conftest.py) writes them once per run.
"""

from __future__ import annotations

from pathlib import Path

import torch


def small_qwen3(d: Path, tokenizer_from: Path, vocab_size: int = 1024) -> Path:
    """Write a Qwen3-MoE checkpoint (hidden 64, 3 layers of which 2 MoE, 8 experts top-2) into
    ``d`` with the tokenizer of ``tokenizer_from``; returns ``d``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    Qwen3MoeForCausalLM(cfg).save_pretrained(d)
    return _with_tokenizer(d, tokenizer_from)


def small_mixtral(d: Path, tokenizer_from: Path, vocab_size: int = 1024) -> Path:
    """Write a Mixtral checkpoint (hidden 64, 2 MoE layers, 4 experts top-2) into ``d`` with the
    tokenizer of ``tokenizer_from``; returns ``d``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(2)
    cfg = MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    MixtralForCausalLM(cfg).save_pretrained(d)
    return _with_tokenizer(d, tokenizer_from)


def _with_tokenizer(d: Path, src: Path) -> Path:
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            (d / f).write_bytes((src / f).read_bytes())
    return d
