"""Continuous-batching generation engine of one attention client.

One scheduler thread owns the model (and with it the KV caches and, through
:class:`~eaas.runtime.client.dispatch.RemoteExperts`, the connections to the expert servers).
API handlers talk to it only through :meth:`Engine.submit` (thread safe) and
:meth:`GenerationRequest.cancel`.

Scheduling (one iteration of the loop = one "step"):

1. Admit every newly submitted request into the waiting queue; drop cancelled requests (a
   cancelled running sequence leaves the decode batch here, i.e. within one step).
2. Prefill at most one waiting request (its own forward over the whole prompt, batch 1) and sample
   its first token (TTFT ends here); unless it already finished, it joins the decode batch.
3. Decode all running sequences in ONE forward: every sequence contributes one new token; the
   per-sequence KV caches live in one left-padded batch cache (see :class:`_DecodeBatch`) with a
   2-D attention mask (0 on padding) and explicit per-sequence position ids, so results equal the
   unbatched computation up to float summation order.
4. Sleep on the admission queue only when nothing is waiting or running.

Sampling: one call per forward into :func:`eaas.runtime.client.sampling.sample` over all rows
(logits processors, penalties, greedy / seeded sampling, logprobs); a seeded request draws from
its own ``torch.Generator``, so it is reproducible whatever else is in the batch.

Stops: an EOS token id of the tokenizer/model (unless ``ignore_eos``), a ``stop_token_ids`` id,
``max_tokens`` generated tokens, or one of the ``stop`` strings appearing in the generated text.
Text comes from an :class:`~eaas.runtime.client.detokenizer.IncrementalDetokenizer` per request
(each token decoded once; the stop string is cut and streamed deltas hold back any suffix that
could still become one).

Failures: an exception in a forward (e.g. :class:`NoLiveReplicaError` from the dispatcher) fails
exactly the requests of that forward (their caches may be half-updated) with an error event; the
engine keeps serving.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from eaas.runtime import metrics
from eaas.runtime.client.detokenizer import IncrementalDetokenizer
from eaas.runtime.client.sampling import SampleOutput, SamplingParams, make_generator, sample

log = logging.getLogger("eaas.client.engine")


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
    """

    token_id: int
    text: str
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    stop_reason: str | int | None = None


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
    _generator: torch.Generator | None = None
    _detok: IncrementalDetokenizer | None = None

    def cancel(self) -> None:
        """Abort (e.g. the HTTP client disconnected): the sequence leaves the batch next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


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
            self.__init__()
            return
        idx = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[i] for i in rows]
        self.lengths = [self.lengths[i] for i in rows]
        self.next_tokens = [self.next_tokens[i] for i in rows]
        mask = self.mask.index_select(0, idx)
        trim = mask.shape[1] - max(self.lengths)
        self.mask = mask[:, trim:]
        self.layers = [
            (k.index_select(0, idx)[..., trim:, :], v.index_select(0, idx)[..., trim:, :])
            for k, v in self.layers
        ]


class Engine:
    """Continuous-batching engine around one Hugging Face causal LM.

    Args:
        model: a transformers ``*ForCausalLM`` (local experts or with ``RemoteExperts``), eval mode.
        tokenizer: its tokenizer (used for detokenization and EOS ids).
        client_id: label of this client's metrics.
        max_num_seqs: decode batch size cap; further requests wait.
        eos_token_ids: override of the stop token ids (default: tokenizer + generation config).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        client_id: str = "0",
        max_num_seqs: int = 64,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.client_id = str(client_id)
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = set(
            eos_token_ids if eos_token_ids is not None else self._default_eos()
        )
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._inbox: queue.SimpleQueue[GenerationRequest | None] = queue.SimpleQueue()
        self._waiting: list[GenerationRequest] = []
        self._batch = _DecodeBatch()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.steps = 0
        self.stats = {"prefills": 0, "decode_steps": 0, "max_batch": 0, "cancelled": 0, "failed": 0}
        self._running_gauge = metrics.RUNNING_SEQS.labels(client_id=self.client_id)
        self._running_gauge.set(0)

    def _default_eos(self) -> list[int]:
        ids: set[int] = set()
        for src in (
            getattr(self.tokenizer, "eos_token_id", None),
            getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
        ):
            if src is None:
                continue
            ids.update([src] if isinstance(src, int) else list(src))
        return sorted(ids)

    # ---- public API (any thread) -----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name=f"eaas-engine-{self.client_id}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None]
    ) -> GenerationRequest:
        """Queue a request; events arrive on ``on_event`` from the scheduler thread.

        Raises:
            ValueError: empty prompt or ``max_tokens < 1``.
        """
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        req = GenerationRequest(prompt_ids=list(prompt_ids), params=params, on_event=on_event)
        self._inbox.put(req)
        return req

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, timeout: float = 300.0
    ) -> GenerationRequest:
        """Blocking convenience: submit and wait for the finished request (raises its error)."""
        done = threading.Event()
        err: list[BaseException] = []

        def cb(ev: Event) -> None:
            if isinstance(ev, ErrorEvent):
                err.append(ev.error)
                done.set()
            elif ev.finish_reason is not None:
                done.set()

        req = self.submit(prompt_ids, params, cb)
        if not done.wait(timeout):
            req.cancel()
            raise TimeoutError(f"generation did not finish within {timeout} s")
        if err:
            raise err[0]
        return req

    @property
    def num_running(self) -> int:
        return len(self._batch)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stopping.is_set():
                try:
                    self._step()
                except Exception:  # never let the scheduler die
                    log.exception("engine step failed")
                    time.sleep(0.05)

    def _admit(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                self._waiting.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

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
        from transformers import DynamicCache

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
        from transformers import DynamicCache

        b = self._batch
        self.stats["decode_steps"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(b))
        ids = torch.tensor(b.next_tokens, dtype=torch.long).unsqueeze(1)  # [B, 1]
        pos = torch.tensor(b.lengths, dtype=torch.long).unsqueeze(1)  # [B, 1]
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

    def _fail(self, reqs: list[GenerationRequest], exc: BaseException) -> None:
        log.warning("forward failed for %d request(s): %s: %s", len(reqs), type(exc).__name__, exc)
        self.stats["failed"] += len(reqs)
        for r in reqs:
            r.finish_reason = "error"
            try:
                r.on_event(ErrorEvent(exc))
            except Exception:  # noqa: BLE001
                log.exception("event callback failed")

    def _sample(self, reqs: list[GenerationRequest], logits: torch.Tensor) -> SampleOutput:
        """One token per request from ``logits`` (``[B, vocab]`` float32), batched."""
        for r in reqs:
            if r._generator is None and r.params.seed is not None and r.params.temperature > 0:
                r._generator = make_generator(r.params.seed)
        return sample(
            logits,
            [r.params for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            [r._generator for r in reqs],
            self.eos_token_ids,
        )

    def _emit(
        self,
        req: GenerationRequest,
        tok: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> bool:
        """Record ``tok``, deliver its event; return True when ``req`` finished."""
        now = time.monotonic()
        if req.last_token_at is None:
            metrics.TTFT_SECONDS.observe(now - req.submitted_at)
        else:
            metrics.ITL_SECONDS.observe(now - req.last_token_at)
        req.last_token_at = now
        p = req.params
        if req._detok is None:
            req._detok = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=p.skip_special_tokens,
                stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output,
                min_tokens=p.min_tokens,
            )
        req.output_ids.append(tok)
        stop_reason: str | int | None = None
        stop_token = False
        if tok in p.stop_token_ids:
            stop_token, stop_reason = True, tok
        elif not p.ignore_eos and tok in self.eos_token_ids:
            stop_token = True
        length = len(req.output_ids) >= p.max_tokens
        delta, matched = req._detok.step(tok, stop_token=stop_token, final=length)
        finish = None
        if stop_token or matched is not None:
            finish = "stop"
            if matched is not None:
                stop_reason = matched
        elif length:
            finish = "length"
        req.text += delta
        req.finish_reason = finish
        try:
            req.on_event(TokenEvent(tok, delta, finish, logprob, top_logprobs, stop_reason))
        except Exception:  # noqa: BLE001
            log.exception("event callback failed")
        return finish is not None
