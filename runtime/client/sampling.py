"""Token sampling for the attention client: logits processors and sampling over the whole batch.

One call, :func:`sample`, turns the ``[B, V]`` float32 logits of one engine step into one token
per sequence. Every stage is a tensor operation over the batch; rows whose request does not use
a stage pass through unchanged. The order follows vLLM's v1 sampler
(``vllm/v1/sample/sampler.py``):

1. ``logprobs`` / ``top_logprobs`` are taken from the **raw** logits (``log_softmax`` before any
   processor, vLLM's default ``logprobs_mode="raw_logprobs"``).
   A structured-output row's grammar mask (:mod:`eaas.runtime.client.structured`) is applied
   by the engine before this call, as vLLM applies its bitmask before the sampler.
2. ``allowed_token_ids`` (every other token ``-inf``), ``logit_bias`` (added), ``min_tokens`` (EOS and ``stop_token_ids`` masked to ``-inf`` while
   fewer than ``min_tokens`` tokens were generated).
3. Penalties: ``repetition_penalty`` over prompt and output tokens (CTRL, Keskar et al. 2019:
   positive logits divided, negative multiplied), then ``frequency_penalty`` (times the count of
   the token in the output) and ``presence_penalty`` (once if present), both as in OpenAI's API.
4. Greedy rows (``temperature == 0``; the API maps any temperature below :data:`SAMPLING_EPS`
   to 0, as vLLM does): ``argmax``.
5. Random rows: divide by ``temperature``; ``min_p`` (drop tokens whose probability is below
   ``min_p`` times the top probability); ``top_k``; ``top_p`` (smallest prefix of the sorted
   distribution whose mass reaches ``top_p``); draw with the exponential-race trick
   ``argmax(p / q)``, ``q ~ Exp(1)``, which equals a categorical draw from ``p``. A seeded
   request draws its ``q`` row from its own ``torch.Generator``, so its tokens do not depend on
   what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing float32 logits by a
# temperature of ~1e-38 overflows them to inf/nan and the draw degenerates to token 0
SAMPLING_EPS = 1e-5
#: logprobs are reported at least this (OpenAI's minimum; vLLM's serving clamps -inf to it)
MIN_LOGPROB = -9999.0


@dataclass
class SamplingParams:
    """How to generate one sequence (OpenAI / vLLM request fields).

    Attributes:
        max_tokens: tokens to generate at most (``>= 1``).
        temperature: ``0`` = greedy; ``> 0`` = sampling.
        top_p: nucleus mass in ``(0, 1]`` (sampling only).
        top_k: keep the ``top_k`` most likely tokens; ``0`` or ``-1`` = all (sampling only).
        min_p: in ``[0, 1]``; drop tokens below ``min_p`` x the top probability (sampling only).
        seed: optional seed of the request's own generator (sampling only).
        stop: stop strings.
        stop_token_ids: token ids that end the sequence (like EOS, even with ``ignore_eos``).
        include_stop_str_in_output: keep the matched stop string / stop token's text in the text.
        ignore_eos: keep generating past EOS tokens (benchmarks, exact-length tests).
        min_tokens: EOS, ``stop_token_ids`` and stop strings cannot end the sequence before this
            many tokens were generated.
        presence_penalty: in ``[-2, 2]``, subtracted once from the logit of every token in the
            output so far.
        frequency_penalty: in ``[-2, 2]``, subtracted per occurrence in the output so far.
        repetition_penalty: ``> 0``; ``1`` = off. Logits of tokens in the prompt or output are
            divided by it when positive and multiplied when negative.
        logit_bias: ``{token_id: bias}`` added to the logits (bias in ``[-100, 100]``).
        logprobs: ``None`` = no logprobs; ``k >= 0`` = the sampled token's logprob and the ``k``
            most likely tokens' logprobs.
        prompt_logprobs: ``None`` = none; ``k >= 0`` = for every prompt token after the first,
            its raw logprob given the tokens before it and the ``k`` most likely tokens there
            (``echo`` with ``logprobs``; vLLM's ``prompt_logprobs``).
        skip_special_tokens: leave special tokens out of the text.
        allowed_token_ids: ``None`` = all; else only these ids can be sampled (vLLM's
            ``allowed_token_ids``; logprobs stay raw, as vLLM's).
        logprob_token_ids: with ``logprobs``: report these ids' raw logprobs (in this order) in
            place of the ``logprobs`` most likely (vLLM's ``logprob_token_ids``).
        grammar: ``None`` or a compiled structured-output constraint
            (:class:`eaas.runtime.client.structured.Grammar`); the engine keeps the sequence
            inside it.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Collection[int] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: Collection[int] | None = None
    grammar: Any = None
    logprob_token_ids: Sequence[int] | None = None
    # per request, built once: (logit_bias ids, values) and the ids min_tokens masks (per eos set)
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    _min_mask: tuple[frozenset[int], torch.Tensor] | None = field(
        default=None, repr=False, compare=False
    )
    _allowed: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """``[V]`` bool, True where ``allowed_token_ids`` forbids the token; built once."""
        if self._allowed is None or self._allowed.numel() != vocab_size:
            m = torch.ones(vocab_size, dtype=torch.bool)
            m[torch.tensor(sorted(self.allowed_token_ids or ()), dtype=torch.int64)] = False
            self._allowed = m
        return self._allowed

    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as ``(ids int64 [n], values float32 [n])``, built on first use."""
        if self._bias is None:
            ids = torch.tensor([int(t) for t in self.logit_bias], dtype=torch.int64)
            vals = torch.tensor([float(b) for b in self.logit_bias.values()], dtype=torch.float32)
            self._bias = (ids, vals)
        return self._bias

    def min_tokens_mask(self, eos_token_ids: Collection[int], vocab_size: int) -> torch.Tensor:
        """Token ids masked while fewer than ``min_tokens`` were generated (int64 ``[m]``): the
        stop token ids, and the EOS ids unless ``ignore_eos``; built once per EOS set."""
        eos = frozenset() if self.ignore_eos else frozenset(eos_token_ids)
        if self._min_mask is None or self._min_mask[0] != eos:
            ids = sorted(t for t in set(self.stop_token_ids) | eos if 0 <= t < vocab_size)
            self._min_mask = (eos, torch.tensor(ids, dtype=torch.int64))
        return self._min_mask[1]


@dataclass
class SampleOutput:
    """What :func:`sample` picked, per batch row.

    Attributes:
        token_ids: ``B`` sampled token ids.
        logprobs: per row the raw logprob of the sampled token, or ``None`` when the row's
            request asked for no logprobs.
        top_logprobs: per row ``[(token_id, logprob)]`` of its ``logprobs`` most likely tokens
            (descending), or ``None``.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator seeded with ``seed`` (signed or unsigned 64 bit), or ``None`` (global RNG)."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def _counts(ids: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """``[B, V]`` int64: how often each token id occurs in each row's ``ids``."""
    B = len(ids)
    lens = torch.tensor([len(x) for x in ids], dtype=torch.long)  # (B,)
    flat = torch.tensor([t for x in ids for t in x], dtype=torch.long)  # (sum lens,)
    rows = torch.repeat_interleave(torch.arange(B), lens)  # (sum lens,)
    out = torch.zeros(B, vocab, dtype=torch.long)
    out.index_put_((rows, flat), torch.ones_like(flat), accumulate=True)
    return out


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Repetition, frequency and presence penalties, in place on ``logits`` ``[B, V]`` float32.

    Returns ``logits``. Rows whose penalties are all neutral come out unchanged.
    """
    B, V = logits.shape
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)  # (B,)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)  # (B,)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)  # (B,)
    out_counts = _counts(output_ids, V)  # (B, V)
    if bool((rep != 1.0).any()):
        seen = (_counts(prompt_ids, V) > 0) | (out_counts > 0)  # (B, V)
        r = rep.unsqueeze(1).expand(B, V)
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalized, logits)
    logits -= freq.unsqueeze(1) * out_counts.to(logits.dtype)
    logits -= pres.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def _apply_bias_and_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_lens: Sequence[int],
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    V = logits.shape[1]
    # one tensor op per row that uses a stage, with the request's ids built once (a request may
    # carry the whole vocabulary in logit_bias or stop_token_ids)
    for b, (p, n) in enumerate(zip(params, output_lens, strict=True)):
        if p.allowed_token_ids is not None:
            logits[b].masked_fill_(p.allowed_mask(V), float("-inf"))
        if p.logit_bias:
            ids, vals = p.bias_tensors()
            logits[b].index_add_(0, ids, vals.to(logits.dtype))
        if n < p.min_tokens:
            masked = p.min_tokens_mask(eos_token_ids, V)
            if masked.numel():
                logits[b, masked] = float("-inf")
    return logits


def _filter_random(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, ``min_p``, ``top_k``, ``top_p`` on the sampled rows; ``[R, V]`` -> probs."""
    R, V = logits.shape
    temp = torch.tensor([p.temperature for p in params], dtype=logits.dtype)  # (R,)
    logits = logits / temp.unsqueeze(1)
    probs = torch.softmax(logits, dim=-1)  # (R, V)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)  # (R,)
    if bool((min_p > 0).any()):
        top = probs.max(dim=-1, keepdim=True).values  # (R, 1)
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * top, 0.0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params])  # (R,)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)  # (R,)
    if bool((top_k < V).any()) or bool((top_p < 1.0).any()):
        sp, si = torch.sort(probs, dim=-1, descending=True)  # (R, V)
        rank = torch.arange(V).unsqueeze(0)  # (1, V)
        drop = rank >= top_k.clamp(max=V).unsqueeze(1)  # (R, V)
        sp = sp.masked_fill(drop, 0.0)
        # mass before each sorted token, of the top-k-renormalized distribution
        mass = sp.sum(dim=-1, keepdim=True)  # (R, 1)
        before = (torch.cumsum(sp, dim=-1) - sp) / mass  # (R, V)
        sp = sp.masked_fill(before > top_p.unsqueeze(1), 0.0)  # keep the prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(1, si, sp)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    eos_token_ids: Collection[int] = (),
) -> SampleOutput:
    """Pick the next token of every sequence of a batch.

    Args:
        logits: ``[B, V]`` float32 logits of the last position of each sequence (not modified).
        params: ``B`` sampling parameters.
        prompt_ids: ``B`` prompts (for ``repetition_penalty``).
        output_ids: ``B`` outputs so far (penalties, ``min_tokens``).
        generators: ``B`` per-request generators (:func:`make_generator`); ``None`` rows draw
            from torch's global RNG.
        eos_token_ids: the model's EOS ids (masked while ``min_tokens`` is not reached, unless
            the row has ``ignore_eos``).

    Returns:
        :class:`SampleOutput`.

    Raises:
        ValueError: the argument lengths differ from ``B``.
    """
    B, V = logits.shape
    if not (len(params) == len(prompt_ids) == len(output_ids) == len(generators) == B):
        raise ValueError("sample: params, prompt_ids, output_ids and generators need B rows")
    want_lp = [p.logprobs for p in params]
    raw_lp = None
    if any(k is not None for k in want_lp):
        # a token a grammar masked has -inf: reported as -9999.0, OpenAI's floor (as vLLM)
        raw_lp = torch.log_softmax(logits.float(), dim=-1).clamp_(min=MIN_LOGPROB)  # (B, V)

    x = logits.float().clone()  # (B, V)
    x = _apply_bias_and_min_tokens(x, params, [len(o) for o in output_ids], eos_token_ids)
    if any(
        p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        for p in params
    ):
        x = apply_penalties(x, params, prompt_ids, output_ids)

    tokens = torch.argmax(x, dim=-1)  # (B,) greedy for every row; random rows overwritten below
    rand = [b for b, p in enumerate(params) if p.temperature > 0]
    if rand:
        idx = torch.tensor(rand)
        probs = _filter_random(x[idx], [params[b] for b in rand])  # (R, V)
        q = torch.empty_like(probs)  # (R, V)
        unseeded = [i for i, b in enumerate(rand) if generators[b] is None]
        if unseeded:
            q[unseeded] = torch.empty(len(unseeded), V).exponential_()
        for i, b in enumerate(rand):
            g = generators[b]
            if g is not None:
                q[i] = torch.empty(V).exponential_(generator=g)
        tokens[idx] = torch.argmax(probs / q, dim=-1)

    token_ids = tokens.tolist()
    lps: list[float | None] = [None] * B
    tops: list[list[tuple[int, float]] | None] = [None] * B
    if raw_lp is not None:
        kmax = max(k for k in want_lp if k is not None)
        chosen = raw_lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()  # (B,)
        top_v, top_i = torch.topk(raw_lp, min(kmax, V), dim=-1)  # (B, kmax), kmax may be 0
        tv, ti = top_v.tolist(), top_i.tolist()
        for b, k in enumerate(want_lp):
            if k is None:
                continue
            lps[b] = chosen[b]
            ids = params[b].logprob_token_ids
            if ids:  # these tokens' raw logprobs instead of the top k (vLLM)
                tops[b] = list(zip(ids, raw_lp[b, list(ids)].tolist(), strict=True))
            else:
                tops[b] = list(zip(ti[b][:k], tv[b][:k], strict=True))
    return SampleOutput(token_ids, lps, tops)


def prompt_logprobs(
    logits: torch.Tensor, targets: Sequence[int], k: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Raw logprobs of the given next tokens (prompt logprobs; vLLM ``prompt_logprobs``).

    Args:
        logits: ``(n, V)`` logits at ``n`` consecutive positions (any float dtype).
        targets: ``n`` token ids: the token that follows each position.
        k: how many most likely tokens to list per position (``>= 0``).

    Returns:
        per position ``(logprob of its target, [(token_id, logprob)] of the k most likely,
        descending)``; logprobs are ``log_softmax`` of the raw logits in float32.

    Raises:
        ValueError: ``len(targets) != n`` or ``k < 0``.
    """
    n, V = logits.shape
    if len(targets) != n or k < 0:
        raise ValueError(f"prompt_logprobs: {len(targets)} targets for {n} rows, k={k}")
    lp = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    chosen = lp.gather(1, torch.tensor(list(targets), dtype=torch.long)[:, None])[:, 0].tolist()
    top_v, top_i = torch.topk(lp, min(k, V), dim=-1)  # (n, k)
    return [
        (chosen[i], list(zip(top_i[i].tolist(), top_v[i].tolist(), strict=True))) for i in range(n)
    ]


__all__ = [
    "SamplingParams",
    "SampleOutput",
    "apply_penalties",
    "make_generator",
    "prompt_logprobs",
    "sample",
]
