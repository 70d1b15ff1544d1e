"""Paged KV cache of one attention client: preallocated blocks, a block table per sequence.

The whole cache is allocated once at start-up (its size bounded by ``--kv-cache-memory``); a
sequence owns a list of block ids (its *block table*); token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``. Admitting, growing, finishing or
preempting a sequence only moves block ids between the free list and block tables: no tensor is
copied or re-allocated (the PagedAttention layout of vLLM, Kwon et al., SOSP 2023, section 4).

What one slot holds per layer (:class:`KVCacheSpec`):

* MLA (DeepSeek-V3): the compressed latent ``[c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)]``
  after ``kv_a_layernorm`` and RoPE, one vector per token shared by all heads (DeepSeek-V2 paper,
  arXiv:2405.04434 section 2.1.2: only the latent is cached);
* GQA (Qwen3-MoE, Mixtral): keys and values, ``num_key_value_heads x head_dim`` each, after RoPE.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from eaas.runtime import metrics
from eaas.runtime.models.attention import storage_dtype

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory_size(text: str) -> int:
    """Bytes of a size such as ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or ``"1000000"``.

    Raises:
        ValueError: not a positive size with a known unit (b, kb, mb, gb, kib, mib, gib, tib).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"bad memory size {text!r}: expected a number with an optional unit "
            "(B, KB, MB, GB, KiB, MiB, GiB, TiB), e.g. 512MiB"
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"bad memory size {text!r}: must be > 0")
    return n


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one cache slot.

    Attributes:
        num_layers: decoder layers (every layer has attention).
        kind: ``"mla"`` (compressed latent) or ``"gqa"`` (keys and values).
        num_kv_heads: key/value heads (GQA) or 1 (MLA).
        key_dim: per-head key width (GQA ``head_dim``; MLA ``kv_lora_rank + qk_rope_head_dim``).
        value_dim: per-head value width (GQA ``head_dim``; MLA 0: values are read from the latent).
        dtype: dtype of the cached tensors (the model's).
    """

    num_layers: int
    kind: str
    num_kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in the cache over all layers."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_heads * (self.key_dim + self.value_dim) * item


def kv_cache_spec(model) -> KVCacheSpec:
    """The :class:`KVCacheSpec` of a transformers DeepSeek-V3 / Qwen3-MoE / Mixtral model, in
    its storage dtype (bfloat16 for a bfloat16 model computing in float32 on CPU).

    Raises:
        ValueError: an architecture without a known attention layout.
    """
    return kv_cache_spec_from_config(model.config, storage_dtype(model))


def kv_cache_spec_from_config(cfg, dtype: torch.dtype) -> KVCacheSpec:
    """:func:`kv_cache_spec` from a transformers config alone (no weights loaded).

    Raises:
        ValueError: an architecture without a known attention layout.
    """
    n = cfg.num_hidden_layers
    if getattr(cfg, "kv_lora_rank", None):
        return KVCacheSpec(n, "mla", 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, 0, dtype)
    if cfg.model_type in ("qwen3_moe", "mixtral"):
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return KVCacheSpec(n, "gqa", cfg.num_key_value_heads, head_dim, head_dim, dtype)
    raise ValueError(f"no paged attention for model type {cfg.model_type!r}")


def min_kv_cache_memory(spec: KVCacheSpec, max_model_len: int, block_size: int = 16) -> int:
    """Bytes of the smallest KV cache the engine accepts: one sequence of ``max_model_len``
    tokens, rounded up to whole blocks of ``block_size`` tokens."""
    return spec.bytes_per_token * block_size * (-(-max_model_len // block_size))


def check_kv_cache_memory(model_dir: str, dtype: torch.dtype, kv_cache_memory: int) -> None:
    """The engine's KV-cache size check, from ``model_dir``'s config alone (seconds before the
    weights would be loaded), for ``eaas serve`` to refuse a bad ``--kv-cache-memory`` up front.

    Raises:
        ValueError: ``kv_cache_memory`` bytes hold less than one sequence of the model's
            ``max_position_embeddings`` tokens (message gives the minimum), or the model has no
            paged-attention layout.
    """
    # lazy: importing transformers' AutoConfig takes seconds; the CLI's up-front check is the
    # only caller and runs once
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    spec = kv_cache_spec_from_config(cfg, dtype)
    minimum = min_kv_cache_memory(spec, int(cfg.max_position_embeddings))
    if kv_cache_memory < minimum:
        raise ValueError(
            f"--kv-cache-memory {kv_cache_memory} B is below one sequence of max_model_len "
            f"{cfg.max_position_embeddings} tokens ({minimum} B at {spec.bytes_per_token} B per "
            "token)"
        )


class BlockAllocator:
    """Free list of block ids ``0 .. num_blocks - 1`` (pure bookkeeping, no tensors).

    Args:
        num_blocks: blocks in the cache (``>= 1``).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids.

        Raises:
            MemoryError: fewer than ``n`` free blocks (nothing is allocated then).
        """
        if n > len(self._free):
            raise MemoryError(f"{n} KV-cache blocks requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Give ``blocks`` back (each must be allocated; order does not matter)."""
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """The preallocated cache tensors plus their :class:`BlockAllocator`.

    Tensors (``S = num_blocks * block_size`` slots), one per layer so each layer's writes and
    gathers touch only its own memory:

    * MLA: ``latent[l]`` ``(S, key_dim)``;
    * GQA: ``keys[l]`` and ``values[l]`` ``(S, num_kv_heads, head_dim)``.

    Args:
        spec: what a slot holds.
        memory_bytes: cache budget; ``num_blocks = memory_bytes // (block_size * bytes_per_token)``.
        block_size: tokens per block.
        device: where the tensors live.
        client_id: label of the ``eaas_kv_cache_*`` gauges.

    Raises:
        ValueError: the budget holds less than one block.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        memory_bytes: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        client_id: str = "0",
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        num_blocks = memory_bytes // (block_size * spec.bytes_per_token)
        if num_blocks < 1:
            raise ValueError(
                f"KV cache memory {memory_bytes} B holds no block of {block_size} tokens "
                f"({spec.bytes_per_token} B per token)"
            )
        self.spec, self.block_size, self.num_blocks = spec, block_size, num_blocks
        self.device = torch.device(device)
        slots = num_blocks * block_size
        h, k, v = spec.num_kv_heads, spec.key_dim, spec.value_dim
        # torch.empty: on CPU untouched pages are not resident until a token is written there.
        if spec.kind == "mla":
            self.latent = [
                torch.empty(slots, k, dtype=spec.dtype, device=self.device)
                for _ in range(spec.num_layers)
            ]
            self.keys = self.values = []
        else:
            self.latent = []
            self.keys = [
                torch.empty(slots, h, k, dtype=spec.dtype, device=self.device)
                for _ in range(spec.num_layers)
            ]
            self.values = [
                torch.empty(slots, h, v, dtype=spec.dtype, device=self.device)
                for _ in range(spec.num_layers)
            ]
        self.allocator = BlockAllocator(num_blocks)
        self.memory_bytes = slots * spec.bytes_per_token
        self._g_total = metrics.KV_CACHE_BLOCKS.labels(client_id=client_id, state="total")
        self._g_used = metrics.KV_CACHE_BLOCKS.labels(client_id=client_id, state="used")
        metrics.KV_CACHE_BYTES.labels(client_id=client_id).set(self.memory_bytes)
        self._g_total.set(num_blocks)
        self.report()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def report(self) -> None:
        """Publish the used-blocks gauge."""
        self._g_used.set(self.allocator.num_used)

    def usage(self) -> dict:
        """``{"blocks_total", "blocks_used", "block_size", "bytes"}`` for stats / health."""
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": self.allocator.num_used,
            "block_size": self.block_size,
            "bytes": self.memory_bytes,
        }


def slot_mapping(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """Cache slots of positions ``start .. start + n - 1`` of a sequence with ``block_table``."""
    return [
        block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)
    ]


__all__ = [
    "BlockAllocator",
    "KVCacheSpec",
    "PagedKVCache",
    "kv_cache_spec",
    "parse_memory_size",
    "slot_mapping",
]
