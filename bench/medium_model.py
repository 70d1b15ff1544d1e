"""A real-shape medium MoE checkpoint for the benchmarks (random weights, never committed).

Qwen3-MoE architecture (``Qwen3MoeForCausalLM``, which vLLM, transformers and this repository's
engine all load) at Qwen3-30B-A3B's layer shapes: hidden 2048, 32 query / 4 KV heads of 128,
``moe_intermediate_size`` 768, top-8 routing, normalized top-k; only the layer count and the
expert count are cut (default 2 MoE layers of 64 experts) so that every system of a
``bench/peer.py`` run (the expert servers hold replicas x experts) fits this machine's memory.
The vocabulary and tokenizer are the built-in tiny model's (1024 ids), so the embedding and LM
head are small: what a decode step costs is attention and the MoE layers at their real shapes.

Written under ``<cache_root>/models/`` (``~/.cache/eaas/models``) in a directory named by its
parameters (:func:`model_name`), once; later calls return the directory. Weights ~ N(0, 0.02)
(transformers' ``initializer_range``), norms 1, each tensor from its own generator seeded by its
name: the same parameters write the same bytes. Stored in ``--store-dtype`` (bfloat16 default,
half the disk and page cache of float32; the systems cast to their ``--dtype`` on load).

Expert weight bytes per copy: ``layers x experts x 3 x 2048 x 768 x itemsize`` (2 x 64 experts:
2.42 GB in float32, 1.21 GB in bfloat16).

Usage::

    python bench/medium_model.py                       # prints the directory
    python bench/medium_model.py --layers 1 --experts 128
    python bench/peer.py --model "$(python bench/medium_model.py)" --vllm-eaas ...
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from eaas.runtime.models.tiny import cache_root, default_model_dir

VERSION = "v1"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MOE_INTERMEDIATE = 2048, 32, 4, 128, 768
STD = 0.02


def model_name(layers: int, experts: int, top_k: int, store_dtype: str) -> str:
    """The directory name of a medium checkpoint (its parameters, so no two collide)."""
    dt = {"bfloat16": "bf16", "float32": "fp32"}[store_dtype]
    return f"medium-qwen3moe-h{HIDDEN}-i{MOE_INTERMEDIATE}-l{layers}-e{experts}-k{top_k}-{dt}-{VERSION}"


def _randn(name: str, shape: tuple[int, ...], std: float, dtype: torch.dtype) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(f"medium/{name}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return (torch.randn(shape, generator=g, dtype=torch.float32) * std).to(dtype)


def _config(layers: int, experts: int, top_k: int, vocab: int, tok_cfg: dict) -> dict:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=6144,  # unused: every layer is MoE
        moe_intermediate_size=MOE_INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_experts=experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_theta=1e6,
        initializer_range=STD,
        tie_word_embeddings=False,
        bos_token_id=tok_cfg.get("bos_token_id"),
        eos_token_id=tok_cfg.get("eos_token_id"),
        pad_token_id=tok_cfg.get("pad_token_id"),
    )
    return cfg


def write_medium_model(
    out: Path, layers: int, experts: int, top_k: int, store_dtype: str = "bfloat16"
) -> Path:
    """Write the checkpoint into ``out`` (config, one ``model.safetensors`` with per-expert keys
    ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``, the tiny model's tokenizer).

    Raises:
        ValueError: ``top_k`` > ``experts`` or a count < 1.
    """
    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    if layers < 1 or experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"medium model: bad layers {layers} / experts {experts} / top-k {top_k}")
    dtype = getattr(torch, store_dtype)
    tiny = default_model_dir()
    tiny_cfg = json.loads((tiny / "config.json").read_text())
    config = _config(layers, experts, top_k, tiny_cfg["vocab_size"], tiny_cfg)
    with torch.device("meta"):
        meta = Qwen3MoeForCausalLM(config)
    sd: dict[str, torch.Tensor] = {}
    for key, p in sorted(meta.state_dict().items()):
        shape = tuple(p.shape)
        if key.endswith(".experts.gate_up_proj"):  # [E, 2I, H] fused in memory, per expert on disk
            base = key[: -len("gate_up_proj")]
            for e in range(shape[0]):
                for part in ("gate_proj", "up_proj"):
                    k = f"{base}{e}.{part}.weight"
                    sd[k] = _randn(k, (shape[1] // 2, shape[2]), STD, dtype)
        elif key.endswith(".experts.down_proj"):  # [E, H, I]
            base = key[: -len("down_proj")]
            for e in range(shape[0]):
                k = f"{base}{e}.down_proj.weight"
                sd[k] = _randn(k, shape[1:], STD, dtype)
        elif key.endswith("norm.weight"):
            sd[key] = torch.ones(shape, dtype=dtype)
        elif len(shape) == 2:
            sd[key] = _randn(key, shape, STD, dtype)
        else:
            raise ValueError(f"medium model: no init rule for {key} {shape}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg["dtype"] = store_dtype
    cfg.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tiny / f, out / f)
    gen = {k: tiny_cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps({**gen, "do_sample": False}) + "\n")
    return out


def medium_model_dir(
    layers: int = 2, experts: int = 64, top_k: int = 8, store_dtype: str = "bfloat16"
) -> Path:
    """The checkpoint's directory under ``<cache_root>/models``, written on first use (a
    ``fcntl`` lock serializes writers; written into a temporary sibling, then renamed)."""
    final = cache_root() / "models" / model_name(layers, experts, top_k, store_dtype)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "config.json").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            write_medium_model(tmp, layers, experts, top_k, store_dtype)
            tmp.chmod(0o755)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="MoE layers")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per layer")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--store-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    a = ap.parse_args(argv)
    print(medium_model_dir(a.layers, a.experts, a.top_k, a.store_dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
