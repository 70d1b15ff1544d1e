"""Beam search (vLLM's ``use_beam_search``), at the API layer over the engine, as vLLM's server.

vLLM's online beam search (``vllm/entrypoints/generate/beam_search/online.py``) is a loop
around its engine: every step submits each live beam (prompt + its tokens) as a one-token
request asking for the ``2 x beam_width`` most likely next tokens' logprobs; every candidate
``beam + token`` scores the beam's cumulative logprob plus the token's; a candidate ending in
EOS (unless ``ignore_eos``) is a completed beam; the ``beam_width`` best others live on. After
``max_tokens`` steps (or when no beam is left) the completed and live beams are ranked by
``cum_logprob / len(tokens) ** length_penalty`` (the prompt counted, a final EOS not:
transformers' score) and the ``beam_width`` best are the answer's choices, best first
(``finish_reason`` ``"stop"`` for an EOS, else ``"length"``). :func:`beam_search` does the
same with :meth:`Engine.submit`. ``beam_width`` is the request's ``n``.

The logprobs are raw (the engine's), so the search is deterministic and the request's
``temperature`` does not change it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from eaas.runtime.client.request import ErrorEvent, GenerationRequest, TokenEvent
from eaas.runtime.client.sampling import SamplingParams


@dataclass
class Beam:
    """A hypothesis: its generated ``tokens`` and their summed raw logprob."""

    tokens: list[int]
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None


def beam_score(beam: Beam, n_prompt: int, eos: int | None, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``: ``cum_logprob / seq_len ** length_penalty`` where
    ``seq_len`` counts the prompt and the tokens, less a final EOS (at least 1)."""
    n = n_prompt + len(beam.tokens)
    if beam.tokens and beam.tokens[-1] == eos:
        n -= 1
    return beam.cum_logprob / (max(n, 1) ** length_penalty)


async def _next_logprobs(engine, ids: list[int], k: int) -> dict[int, float]:
    """``{token id: raw logprob}`` of the ``k`` most likely next tokens after ``ids`` (and the
    one the engine drew). Raises: the engine's error (e.g. ``NoLiveReplicaError``)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def on_event(ev) -> None:
        def deliver() -> None:
            if fut.done():
                return
            if isinstance(ev, ErrorEvent):
                fut.set_exception(ev.error)
            elif ev.finish_reason is not None:
                fut.set_result(ev)

        if not loop.is_closed():
            loop.call_soon_threadsafe(deliver)

    req = engine.submit(ids, SamplingParams(max_tokens=1, logprobs=k, ignore_eos=True), on_event)
    try:
        ev: TokenEvent = await fut
    except asyncio.CancelledError:
        req.cancel()
        raise
    out = dict(ev.top_logprobs or ())
    if ev.logprob is not None:
        out[ev.token_id] = ev.logprob
    return out


async def beam_search(
    engine,
    prompt: list[int],
    beam_width: int,
    max_tokens: int,
    eos_token_id: int | None,
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
    include_stop_str_in_output: bool = False,
) -> list[Beam]:
    """The ``beam_width`` best beams of ``prompt`` (best first), as vLLM's online beam search
    (module docstring).

    Args:
        engine: the running engine (:meth:`Engine.submit`).
        prompt: the prompt's token ids.
        beam_width: beams kept (the request's ``n``).
        max_tokens: steps (tokens per beam) at most.
        eos_token_id: the tokenizer's EOS id (ends a beam unless ``ignore_eos``).
        length_penalty: exponent of the length in the score.
        include_stop_str_in_output: keep the EOS token in a completed beam's tokens.

    Raises:
        the engine's error for a failed step.
    """
    live = [Beam([])]
    done: list[Beam] = []
    for _ in range(max_tokens):
        steps = await asyncio.gather(
            *(_next_logprobs(engine, prompt + b.tokens, 2 * beam_width) for b in live)
        )
        cands: list[tuple[float, int, Beam]] = []
        for beam, lps in zip(live, steps, strict=True):
            for tok, lp in lps.items():
                score = beam.cum_logprob + lp
                if tok == eos_token_id and not ignore_eos:
                    toks = beam.tokens + [tok] if include_stop_str_in_output else beam.tokens
                    done.append(Beam(toks, score, "stop", tok))
                else:
                    cands.append((score, tok, beam))
        cands.sort(key=lambda c: -c[0])
        live = [Beam(b.tokens + [t], s) for s, t, b in cands[:beam_width]]
        if not live:
            break
    ranked = sorted(
        done + live,
        key=lambda b: beam_score(b, len(prompt), eos_token_id, length_penalty),
        reverse=True,
    )
    return ranked[:beam_width]


def finished_request(
    tokenizer, prompt: list[int], beam: Beam, params: SamplingParams, eos: int | None
) -> GenerationRequest:
    """A finished :class:`GenerationRequest` holding ``beam`` (what the answer's builders
    read: ``output_ids``, ``text``, ``finish_reason``)."""
    req = GenerationRequest(prompt_ids=list(prompt), params=params, on_event=lambda ev: None)
    req.output_ids = list(beam.tokens)
    shown = beam.tokens[:-1] if beam.tokens and beam.tokens[-1] == eos else beam.tokens
    if params.include_stop_str_in_output:
        shown = beam.tokens
    req.text = tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
    req.finish_reason = beam.finish_reason or "length"
    return req


__all__ = ["Beam", "beam_score", "beam_search", "finished_request"]
