"""The attention client's model runner: the decoder stack over a paged KV cache, for
DeepSeek-V3 (MLA), Qwen3-MoE and Mixtral (GQA).

:class:`PagedModelRunner` runs a transformers ``*ForCausalLM`` (as loaded by
:func:`eaas.runtime.models.attention.load_attention_model`) layer by layer with the model's own
modules and weights (embeddings, norms, projections, rotary embedding, the MoE block with its
router, shared experts and routed-experts seam of :mod:`eaas.runtime.client.moe`, ``lm_head``); only attention and the KV cache are
ours. One forward takes a *varlen* batch: any number of sequences, each contributing a chunk of
consecutive tokens (one token = decode, more = a prefill chunk), all flattened into ``T`` tokens
so every projection and every MoE layer call runs once per step for decode and prefill tokens
together. Attention runs per group: all one-token chunks in one batched call over their block
tables, each longer chunk in its own causal call over its cached prefix plus itself.

MLA (DeepSeek-V2 paper arXiv:2405.04434 section 2.1.2 and appendix C; vLLM ``MLACommonImpl``):
the cache holds the latent ``[c_kv | k_rope]``. One-token chunks use the *weight-absorbed* form:
with ``kv_b_proj.weight`` viewed as ``W_UK (H, d_nope, r)`` and ``W_UV (H, d_v, r)``,
``q_lat = q_nope @ W_UK`` and attention runs directly over the cached latent (keys
``[c_kv | k_rope]``, values ``c_kv``; multi-query, one latent head), then
``o = o_lat @ W_UV^T``: no matmul over cached positions. Longer chunks expand their context
through ``kv_b_proj`` (the expanded form, cheaper for many queries).

Results equal transformers' forward up to float summation order (tests compare greedy tokens
with ``generate`` and logits within fp32 tolerance).

The KV cache may be kept in a narrower dtype than the model computes in (a bfloat16 model
computing in float32 on CPU, :mod:`eaas.runtime.models.compute`): keys, values and latents are
rounded to the cache's dtype on write and upcast to the compute dtype after each gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eaas.runtime.client.kv_cache import PagedKVCache
from eaas.runtime.client.moe import overlapped_moe_forward


@dataclass
class Chunk:
    """One sequence's tokens in a forward.

    Attributes:
        token_ids: the ``n`` input token ids (positions ``start .. start + n - 1``).
        start: tokens of this sequence already in the cache (= position of the first token).
        block_table: the sequence's block ids, covering at least ``start + n`` tokens.
        want_logits: return next-token logits of this chunk's last position.
        all_logits: also return the next-token logits of every position of the chunk
            (:meth:`PagedModelRunner.forward_full`; prompt logprobs).
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    want_logits: bool = True
    all_logits: bool = False


@dataclass
class _Meta:
    """Per-forward index tensors shared by all layers (built once per step)."""

    slots: torch.Tensor  # (T,) int64 cache slot of every input token
    cos: torch.Tensor  # (T, d_rope)
    sin: torch.Tensor  # (T, d_rope)
    dec_rows: torch.Tensor  # (Bd,) token rows of one-token chunks
    dec_slots: torch.Tensor  # (Bd, L) cache slot of every context position; past the end: slot 0's
    dec_mask: torch.Tensor  # (Bd, L) bool, True = attend
    pre: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (row0, n, blocks, mask (n, ctx))


class PagedModelRunner:
    """Forward of a transformers MoE CausalLM over a :class:`PagedKVCache`.

    Args:
        model: ``DeepseekV3ForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` in
            eval mode (routed experts local or the ``RemoteExperts`` seam).
        cache: the KV cache, built from :func:`~eaas.runtime.client.kv_cache.kv_cache_spec` of
            ``model``, on the model's device.

    Raises:
        ValueError: an unsupported architecture.
    """

    def __init__(self, model, cache: PagedKVCache):
        self.model = model
        self.cache = cache
        self.cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.mla = cache.spec.kind == "mla"
        self.sliding_window = getattr(self.cfg, "sliding_window", None)
        mt = self.cfg.model_type
        # per layer: the MLP / MoE block's forward; a DeepSeek-V3 block with remote routed
        # experts computes its shared expert while they run on the expert servers (bit-exact)
        self.mlp_forwards = [
            overlapped_moe_forward(lyr.mlp) or lyr.mlp for lyr in model.model.layers
        ]
        # lazy (the three below): each of transformers' modeling modules takes seconds to
        # import; only the architecture of the model in use is imported
        if self.mla:
            from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

            self._rope = (
                m.apply_rotary_pos_emb_interleave
                if getattr(self.cfg, "rope_interleave", False)
                else m.apply_rotary_pos_emb
            )
            self._absorbed = []
            for layer in model.model.layers:
                a = layer.self_attn
                h, dn, dv = a.num_heads, a.qk_nope_head_dim, a.v_head_dim
                w = a.kv_b_proj.weight.view(h, dn + dv, a.kv_lora_rank)  # (H, dn + dv, r)
                w_uk = w[:, :dn, :].contiguous()  # (H, dn, r)
                w_uv_t = w[:, dn:, :].transpose(1, 2).contiguous()  # (H, r, dv)
                self._absorbed.append((w_uk, w_uv_t))
        elif mt == "qwen3_moe":
            from transformers.models.qwen3_moe import modeling_qwen3_moe

            self._rope = modeling_qwen3_moe.apply_rotary_pos_emb
        elif mt == "mixtral":
            from transformers.models.mixtral import modeling_mixtral

            self._rope = modeling_mixtral.apply_rotary_pos_emb
        else:
            raise ValueError(f"no paged attention for model type {mt!r}")

    # ---- batch metadata ------------------------------------------------------------------
    def _visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool mask: key position ``k_pos`` visible to query ``q_pos`` (causal + window)."""
        m = k_pos <= q_pos
        if self.sliding_window:
            m = m & (q_pos - k_pos < self.sliding_window)
        return m

    def _meta(self, chunks: list[Chunk], hidden: torch.Tensor) -> _Meta:
        """Index tensors of one forward: token slots and positions (Python ints, one tensor
        each), the decode rows' context slots ``(Bd, L)`` and mask, each prefill chunk's blocks
        and causal mask. Decode context positions past a sequence's end point at the slot of its
        position 0 (always written), so every gathered value is finite: masked positions then
        add exactly 0 (never-written cache memory may hold NaN, and ``0 * NaN`` is NaN)."""
        bs = self.cache.block_size
        positions: list[int] = []
        slots: list[int] = []
        dec_rows, dec_tables, dec_ctx = [], [], []
        pre = []
        row = 0
        for c in chunks:
            n = len(c.token_ids)
            start, ctx, bt = c.start, c.start + n, c.block_table
            if n == 1:
                positions.append(start)
                slots.append(bt[start // bs] * bs + start % bs)
                dec_rows.append(row)
                dec_tables.append(bt[: -(-ctx // bs)])
                dec_ctx.append(ctx)
            else:
                positions.extend(range(start, ctx))
                slots.extend(bt[p // bs] * bs + p % bs for p in range(start, ctx))
                pos = torch.arange(start, ctx, dtype=torch.long)
                k_pos = torch.arange(ctx, dtype=torch.long)
                mask = self._visible(pos[:, None], k_pos[None, :])  # (n, ctx)
                blocks = torch.tensor(bt[: -(-ctx // bs)], dtype=torch.long)
                pre.append((row, n, blocks.to(self.device), mask.to(self.device)))
            row += n
        dev = self.device
        if dec_rows:
            nb = max(len(t) for t in dec_tables)
            blocks = torch.tensor([t + [t[0]] * (nb - len(t)) for t in dec_tables])  # (Bd, nb)
            in_block = torch.arange(bs, dtype=torch.long)
            dslots = (blocks[:, :, None] * bs + in_block).view(len(dec_rows), nb * bs)  # (Bd, L)
            k_pos = torch.arange(nb * bs, dtype=torch.long)[None, :]  # (1, L)
            ctx_t = torch.tensor(dec_ctx, dtype=torch.long)[:, None]  # (Bd, 1)
            written = k_pos < ctx_t  # (Bd, L)
            dslots = torch.where(written, dslots, dslots[:, :1])
            dec_mask = written & self._visible(ctx_t - 1, k_pos)  # (Bd, L)
        else:
            dslots = torch.zeros(0, bs, dtype=torch.long)
            dec_mask = torch.zeros(0, bs, dtype=torch.bool)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        cos, sin = self.model.model.rotary_emb(hidden, pos_t[None, :])  # (1, T, d)
        return _Meta(
            slots=torch.tensor(slots, dtype=torch.long).to(dev),
            cos=cos[0],
            sin=sin[0],
            dec_rows=torch.tensor(dec_rows, dtype=torch.long, device=dev),
            dec_slots=dslots.to(dev),
            dec_mask=dec_mask.to(dev),
            pre=pre,
        )

    # ---- forward -------------------------------------------------------------------------
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run one varlen step, writing every chunk's keys/values (or latents) into the cache.

        Args:
            chunks: non-empty; each chunk's ``block_table`` must cover ``start + n`` tokens and
                its positions ``< start`` must already be cached.

        Returns:
            ``(B, vocab)`` float32 next-token logits of the chunks with ``want_logits``, in order.
        """
        return self.forward_full(chunks)[0]

    @torch.inference_mode()
    def forward_full(self, chunks: list[Chunk]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`forward`, plus the logits of every position of the chunks with ``all_logits``.

        Returns:
            ``(logits, per_chunk)``: ``logits`` as :meth:`forward`; ``per_chunk`` maps the index
            (in ``chunks``) of each chunk with ``all_logits`` to its ``(n, vocab)`` float32
            next-token logits (row ``i``: after the chunk's token ``i``).
        """
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        inner = self.model.model
        x = inner.embed_tokens(ids.to(self.device))  # (T, H)
        meta = self._meta(chunks, x)
        for li, layer in enumerate(inner.layers):
            h = layer.input_layernorm(x)
            if self.mla:
                a = self._mla(li, layer.self_attn, h, meta)
            else:
                a = self._gqa(li, layer.self_attn, h, meta)
            x = x + a
            h = layer.post_attention_layernorm(x)
            m = self.mlp_forwards[li](h[None])  # the model's MLP / MoE block over (1, T, H)
            x = x + (m[0] if isinstance(m, tuple) else m)[0]
        ends, row = [], 0
        full: dict[int, torch.Tensor] = {}
        for i, c in enumerate(chunks):
            if c.all_logits:  # (n, H) -> (n, V)
                full[i] = self.model.lm_head(inner.norm(x[row : row + len(c.token_ids)])).float()
            row += len(c.token_ids)
            if c.want_logits:
                ends.append(row - 1)
        x = inner.norm(x[torch.tensor(ends, dtype=torch.long, device=self.device)])  # (B, H)
        return self.model.lm_head(x).float(), full  # (B, V)

    def _attend(self, q, k, v, mask, scale, gqa: bool) -> torch.Tensor:
        """Prefill attention of one chunk: SDPA, in the form its fused CPU kernel takes.

        q (B, Hq, n, dk), k (B, Hk, L, dk), v (B, Hk, L, dv), mask bool broadcastable to
        (B, 1, n, L) -> (B, Hq, n, dv). On CPU, SDPA's fused (flash) kernel needs ``dv == dk``;
        MLA has ``dv < dk`` (DeepSeek-V3: 128 vs 192), and the math fallback materializes the
        (n, L) scores: 2-4x slower at 220-1024 tokens here. So ``v`` is zero-padded to ``dk``
        (the extra output columns are exactly 0 and dropped). A chunk that is a whole prompt
        (``n == L``, no sliding window cuts it) uses ``is_causal`` instead of the dense mask:
        the same top-left causal mask, without reading it (1.8x at 1024 tokens).
        """
        n, L, dk, dv = q.shape[2], k.shape[2], q.shape[-1], v.shape[-1]
        pad = q.device.type == "cpu" and dv < dk
        if pad:
            v = F.pad(v, (0, dk - dv))  # (B, Hk, L, dk)
        causal = n == L and (not self.sliding_window or L <= self.sliding_window)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if causal else mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa and k.shape[1] != q.shape[1],
        )
        return o[..., :dv] if pad else o

    @staticmethod
    def _decode_attend(q, k, v, valid, scale: float) -> torch.Tensor:
        """Attention of one query per sequence over its padded context (batched matmuls; on CPU
        several times faster than SDPA's masked path for a single query).

        q (B, Hq, dk); k (B, L, Hk, dk); v (B, L, Hk, dv); valid (B, L) bool -> (B, Hq, dv).
        Softmax in float32 (as transformers' eager attention). ``v`` must be finite at the
        invalid positions too (they get probability 0, and ``0 * NaN`` is NaN): the gather of
        :meth:`_meta`'s ``dec_slots`` points them at a written slot.
        """
        B, Hq, dk = q.shape
        Hk = k.shape[2]
        qg = q.view(B, Hk, Hq // Hk, dk)  # (B, Hk, g, dk)
        s = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # (B, Hk, g, L)
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(v.dtype)
        o = torch.matmul(p, v.permute(0, 2, 1, 3))  # (B, Hk, g, dv)
        return o.reshape(B, Hq, -1)

    def _gqa(self, li: int, attn, h: torch.Tensor, meta: _Meta) -> torch.Tensor:
        T = h.shape[0]
        d = attn.head_dim
        q = attn.q_proj(h).view(T, -1, d)  # (T, Hq, d)
        k = attn.k_proj(h).view(T, -1, d)  # (T, Hk, d)
        v = attn.v_proj(h).view(T, -1, d)  # (T, Hk, d)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over head_dim before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rope(q, k, meta.cos, meta.sin, unsqueeze_dim=1)
        kc, vc = self.cache.keys[li], self.cache.values[li]  # (S, Hk, d)
        kc.index_copy_(0, meta.slots, k.to(kc.dtype))
        vc.index_copy_(0, meta.slots, v.to(vc.dtype))
        bs = self.cache.block_size
        hk = kc.shape[1]
        out = q.new_empty(T, q.shape[1], d)  # (T, Hq, d)
        if len(meta.dec_rows):
            B, L = meta.dec_slots.shape
            flat = meta.dec_slots.view(-1)  # (B * L,)
            kb = kc.index_select(0, flat).view(B, L, hk, d).to(q.dtype)  # cache -> compute dtype
            vb = vc.index_select(0, flat).view(B, L, hk, d).to(q.dtype)
            qd = q[meta.dec_rows]  # (Bd, Hq, d)
            out[meta.dec_rows] = self._decode_attend(qd, kb, vb, meta.dec_mask, attn.scaling)
        for row0, n, blocks, mask in meta.pre:
            ctx = mask.shape[1]
            kb = kc.view(-1, bs, hk, d)[blocks].view(-1, hk, d)[:ctx].transpose(0, 1)[None]
            vb = vc.view(-1, bs, hk, d)[blocks].view(-1, hk, d)[:ctx].transpose(0, 1)[None]
            kb, vb = kb.to(q.dtype), vb.to(q.dtype)  # cache -> compute dtype (no-op if equal)
            qp = q[row0 : row0 + n].transpose(0, 1)[None]  # (1, Hq, n, d)
            o = self._attend(qp, kb, vb, mask[None, None], attn.scaling, True)  # (1, Hq, n, d)
            out[row0 : row0 + n] = o[0].transpose(0, 1)
        return attn.o_proj(out.reshape(T, -1))  # (T, H)

    def _mla(self, li: int, attn, h: torch.Tensor, meta: _Meta) -> torch.Tensor:
        T = h.shape[0]
        H, dn, dr, dv = (
            attn.num_heads,
            attn.qk_nope_head_dim,
            attn.qk_rope_head_dim,
            attn.v_head_dim,
        )
        r = attn.kv_lora_rank
        if attn.q_lora_rank is None:
            q = attn.q_proj(h)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h)))
        q = q.view(T, H, dn + dr)
        q_nope, q_rot = q[..., :dn], q[..., dn:]  # (T, H, dn), (T, H, dr)
        ckv = attn.kv_a_proj_with_mqa(h)  # (T, r + dr)
        c = attn.kv_a_layernorm(ckv[:, :r])  # (T, r)
        k_rot = ckv[:, None, r:]  # (T, 1, dr)
        q_rot, k_rot = self._rope(q_rot, k_rot, meta.cos, meta.sin, unsqueeze_dim=1)
        lat = self.cache.latent[li]  # (S, r + dr)
        lat.index_copy_(0, meta.slots, torch.cat([c, k_rot[:, 0]], dim=-1).to(lat.dtype))
        bs = self.cache.block_size
        out = q.new_empty(T, H, dv)
        if len(meta.dec_rows):
            # absorbed: attention over the latent, no kv_b_proj over cached positions
            w_uk, w_uv_t = self._absorbed[li]
            rows = meta.dec_rows
            B, L = meta.dec_slots.shape
            q_lat = torch.bmm(q_nope[rows].transpose(0, 1), w_uk).transpose(0, 1)  # (Bd, H, r)
            qq = torch.cat([q_lat, q_rot[rows]], dim=-1)  # (Bd, H, r + dr)
            kv = lat.index_select(0, meta.dec_slots.view(-1)).view(B, L, 1, r + dr).to(qq.dtype)
            # one latent head shared by all query heads: keys [c_kv | k_rope], values c_kv
            o_lat = self._decode_attend(qq, kv, kv[..., :r], meta.dec_mask, attn.scaling)
            # o_lat (Bd, H, r) -> (H, Bd, r) @ (H, r, dv) -> (Bd, H, dv)
            out[rows] = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
        for row0, n, blocks, mask in meta.pre:
            # expanded: kv_b_proj over the chunk's context, then ordinary causal attention
            ctx = mask.shape[1]
            cl = lat.view(-1, bs, r + dr)[blocks].view(-1, r + dr)[:ctx].to(q.dtype)  # (ctx, r+dr)
            kv = attn.kv_b_proj(cl[:, :r]).view(ctx, H, dn + dv)
            k = torch.cat([kv[..., :dn], cl[:, None, r:].expand(ctx, H, dr)], dim=-1)
            qp = torch.cat([q_nope[row0 : row0 + n], q_rot[row0 : row0 + n]], dim=-1)
            o = self._attend(
                qp.transpose(0, 1)[None],  # (1, H, n, dn + dr)
                k.transpose(0, 1)[None],  # (1, H, ctx, dn + dr)
                kv[..., dn:].transpose(0, 1)[None],  # (1, H, ctx, dv)
                mask[None, None],
                attn.scaling,
                False,
            )  # (1, H, n, dv)
            out[row0 : row0 + n] = o[0].transpose(0, 1)
        return attn.o_proj(out.reshape(T, H * dv))  # (T, H)


__all__ = ["Chunk", "PagedModelRunner"]
