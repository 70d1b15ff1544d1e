"""The previous engine, kept as an exactness oracle for tests: transformers' own forward.

:class:`ReferenceEngine` runs the model's ``forward`` with transformers' ``DynamicCache``: one
prefill per step (batch 1, whole prompt), then all running sequences decode in one forward over a
merged, left-padded cache (:class:`_DecodeBatch`) with a 2-D attention mask and explicit
per-sequence position ids. It is slow (MLA re-expands every cached latent each step, the cache is
re-padded with ``torch.cat`` on admission) but its arithmetic is transformers', so tests compare
:class:`~eaas.runtime.client.engine.Engine` against it. Same public interface as ``Engine``.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from eaas.runtime.client.engine import EngineBase
from eaas.runtime.client.request import GenerationRequest


class _DecodeBatch:
    """The running sequences and their merged, left-padded KV cache.

    Per model layer the cache holds ``(keys, values)`` shaped ``[B, heads, L, d]`` (for MLA
    models ``heads == 1`` and ``d`` = latent widths); row ``b`` holds sequence ``b``'s
    ``lengths[b]`` cached positions right-aligned, ``mask[b]`` (``[B, L]`` int64) is 1 on them and
    0 on the left padding. Adding a sequence re-pads; removing one selects rows and trims columns
    that became all padding.
    """

    def __init__(self) -> None:
        self.seqs: list[GenerationRequest] = []
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.mask: torch.Tensor | None = None  # [B, L]
        self.lengths: list[int] = []  # cached tokens per sequence (= next position id)
        self.next_tokens: list[int] = []  # last sampled token per sequence (input of the next step)

    def __len__(self) -> int:
        return len(self.seqs)

    @staticmethod
    def _lpad(t: torch.Tensor, n: int) -> torch.Tensor:
        if n == 0:
            return t
        pad = t.new_zeros(*t.shape[:-2], n, t.shape[-1])
        return torch.cat([pad, t], dim=-2)

    def add(
        self,
        seq: GenerationRequest,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        length: int,
        token: int,
    ) -> None:
        """Append a prefilled sequence; ``layers`` are its ``[1, heads, length, d]`` caches."""
        m = torch.ones(1, length, dtype=torch.long)
        if not self.seqs:
            self.layers, self.mask = list(layers), m
        else:
            assert self.mask is not None
            cur = self.mask.shape[1]
            L = max(cur, length)
            self.layers = [
                (
                    torch.cat([self._lpad(k, L - cur), self._lpad(nk, L - length)], dim=0),
                    torch.cat([self._lpad(v, L - cur), self._lpad(nv, L - length)], dim=0),
                )
                for (k, v), (nk, nv) in zip(self.layers, layers, strict=False)
            ]
            self.mask = torch.cat(
                [
                    torch.cat([self.mask.new_zeros(len(self.seqs), L - cur), self.mask], 1),
                    torch.cat([m.new_zeros(1, L - length), m], 1),
                ],
                0,
            )
        self.seqs.append(seq)
        self.lengths.append(length)
        self.next_tokens.append(token)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices into the batch), in that order."""
        if len(rows) == len(self.seqs):
            return
        if not rows:
            self.seqs, self.layers, self.mask = [], [], None
            self.lengths, self.next_tokens = [], []
            return
        idx = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
        self.next_tokens = [self.next_tokens[i] for i in rows]
        assert self.mask is not None
        mask = self.mask.index_select(0, idx)
        trim = mask.shape[1] - max(self.lengths)
        self.mask = mask[:, trim:]
        self.layers = [
            (k.index_select(0, idx)[..., trim:, :], v.index_select(0, idx)[..., trim:, :])
            for k, v in self.layers
        ]


class ReferenceEngine(EngineBase):
    """Engine on transformers' forward and ``DynamicCache`` (see the module docstring).

    Args: as :class:`~eaas.runtime.client.engine.EngineBase`.
    """

    def __init__(self, model, tokenizer, **kw) -> None:
        super().__init__(model, tokenizer, **kw)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._waiting: list[GenerationRequest] = []
        self._batch = _DecodeBatch()

    @property
    def num_running(self) -> int:
        return len(self._batch)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def _enqueue(self, req: GenerationRequest) -> None:
        self._waiting.append(req)

    def _step(self) -> None:
        self._admit(block=not self._waiting and not len(self._batch))
        # Drop cancelled requests (waiting or running).
        for r in [r for r in self._waiting if r.cancelled]:
            self._waiting.remove(r)
            r.finish_reason = "cancelled"
            self.stats["cancelled"] += 1
        if any(s.cancelled for s in self._batch.seqs):
            rows = []
            for i, s in enumerate(self._batch.seqs):
                if s.cancelled:
                    s.finish_reason = "cancelled"
                else:
                    rows.append(i)
            self.stats["cancelled"] += len(self._batch) - len(rows)
            self._batch.keep(rows)
            self._running_gauge.set(len(self._batch))
        if self._waiting and len(self._batch) < self.max_num_seqs:
            self._prefill(self._waiting.pop(0))
        if len(self._batch):
            self._decode()
        self._running_gauge.set(len(self._batch))
        self._waiting_gauge.set(len(self._waiting))
        self.steps += 1

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        kw = {self._cache_kw: cache}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **kw,
        )
        return out.logits[:, -1, :].float(), cache

    def _prefill(self, req: GenerationRequest) -> None:
        n = len(req.prompt_ids)
        self.stats["prefills"] += 1
        ids = torch.tensor([req.prompt_ids], dtype=torch.long)
        try:
            logits, cache = self._forward(
                ids,
                torch.ones(1, n, dtype=torch.long),
                torch.arange(n).unsqueeze(0),
                DynamicCache(),
            )
            out = self._sample([req], logits)
        except Exception as exc:  # noqa: BLE001
            self._fail([req], exc)
            return
        tok = out.token_ids[0]
        if self._emit(req, tok, out.logprobs[0], out.top_logprobs[0]):
            return
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        self._batch.add(req, layers, n, tok)

    def _decode(self) -> None:
        b = self._batch
        self.stats["decode_steps"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(b))
        ids = torch.tensor(b.next_tokens, dtype=torch.long).unsqueeze(1)  # [B, 1]
        pos = torch.tensor(b.lengths, dtype=torch.long).unsqueeze(1)  # [B, 1]
        assert b.mask is not None
        mask = torch.cat([b.mask, torch.ones(len(b), 1, dtype=torch.long)], dim=1)  # [B, L+1]
        try:
            cache = DynamicCache(ddp_cache_data=b.layers)
            logits, cache = self._forward(ids, mask, pos, cache)
            out = self._sample(b.seqs, logits)
            toks = out.token_ids
        except Exception as exc:  # noqa: BLE001
            self._fail(list(b.seqs), exc)
            b.keep([])
            return
        b.layers = [(layer.keys, layer.values) for layer in cache.layers]
        b.mask = mask
        b.lengths = [n + 1 for n in b.lengths]
        b.next_tokens = toks
        rows = [
            i
            for i, (s, t) in enumerate(zip(b.seqs, toks, strict=True))
            if not self._emit(s, t, out.logprobs[i], out.top_logprobs[i])
        ]
        b.keep(rows)


__all__ = ["ReferenceEngine"]
