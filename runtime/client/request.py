"""The attention client's request type: a generation request and the events it receives.

A leaf module (nano-vllm's ``engine/sequence.py``): the engine
(:mod:`eaas.runtime.client.engine`) creates :class:`GenerationRequest` objects and calls their
``on_event`` callbacks; the step scheduler (:mod:`eaas.runtime.client.scheduler`) carries them
without reading them; the API layer (:mod:`eaas.runtime.client.api`) submits them and turns the
events into responses. It imports neither the engine nor the scheduler.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eaas.runtime.client.detokenizer import IncrementalDetokenizer
from eaas.runtime.client.sampling import SamplingParams
from eaas.runtime.client.structured import GrammarState


@dataclass
class TokenEvent:
    """One generated token, delivered to the request's callback on the scheduler thread.

    Attributes:
        token_id: the sampled token id.
        text: text delta to append (may be ``""`` while held back for detokenization/stops).
        finish_reason: ``None`` while running; ``"stop"`` (EOS, stop token or stop string) or
            ``"length"``.
        logprob: raw logprob of ``token_id`` when the request asked for ``logprobs``.
        top_logprobs: ``[(token_id, logprob)]`` of the ``logprobs`` most likely tokens.
        stop_reason: the matched stop string or stop token id (``None`` for EOS / length).
        prompt_logprobs: on a request's first event when it asked for ``prompt_logprobs``: per
            prompt token ``None`` (the first) or ``(logprob, [(token_id, logprob)] top-k)``.
    """

    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


@dataclass
class ErrorEvent:
    """The request failed; ``error`` is the exception (e.g. ``NoLiveReplicaError``)."""

    error: BaseException


Event = TokenEvent | ErrorEvent

_ids = itertools.count()


@dataclass(eq=False)
class GenerationRequest:
    """A request inside the engine (created by :meth:`Engine.submit`).

    Attributes:
        prompt_ids: prompt token ids (non-empty).
        params: sampling parameters.
        on_event: callback ``(Event) -> None`` called on the scheduler thread; must not block.
        output_ids: generated token ids so far.
        text: generated text so far (what was delivered, stop strings cut).
        finish_reason: final reason once finished, ``"cancelled"`` or ``"error"``.
        prompt_logprobs: with ``params.prompt_logprobs``: per prompt token ``None`` (the first,
            and any not computed yet) or ``(logprob, top-k)``, filled while the prompt prefills.
    """

    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    request_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    _generator: torch.Generator | None = None
    _detok: IncrementalDetokenizer | None = None
    _grammar: GrammarState | None = None  # with params.grammar: the sequence's matcher

    def cancel(self) -> None:
        """Abort (e.g. the HTTP client disconnected): the sequence leaves the batch next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def num_tokens(self) -> int:
        """Current sequence length: prompt plus generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
