"""Continuous-batching generation engine of one attention client.

One scheduler thread owns the model, the paged KV cache and (through
:class:`~eaas.runtime.client.dispatch.RemoteExperts`) the connections to the expert servers. API
handlers talk to it only through :meth:`Engine.submit` (thread safe) and
:meth:`GenerationRequest.cancel`.

One iteration of the loop (a "step", :meth:`Engine._step`: schedule -> run -> postprocess, as
nano-vllm's ``LLMEngine.step``):

1. Schedule (:meth:`Engine._schedule`): take newly submitted requests into the waiting queue
   (sleeping on the admission queue only when nothing is waiting or running); drop cancelled
   requests (waiting or running: a running one leaves within one step, i.e. within one prefill
   chunk); plan the step (:class:`~eaas.runtime.client.scheduler.Scheduler`): every running
   sequence's decode token, the next chunks of prompts being prefilled, and newly admitted
   prompts, under a token budget (``max_num_batched_tokens``) and the free KV-cache blocks;
   preemption (recompute) when a decode finds the cache full.
2. Run (:meth:`Engine._run`): ONE forward over all of them
   (:class:`~eaas.runtime.client.model_runner.PagedModelRunner`: varlen batch over the paged
   cache, MLA decode in the weight-absorbed form), then sample the next token of every sequence
   whose chunk reached its end (one call: :meth:`EngineBase._sample`).
3. Postprocess (:meth:`Engine._postprocess`): advance the scheduler, count the step, deliver the
   events (:meth:`EngineBase._emit`: stops, detokenization).

Requests, events: :mod:`eaas.runtime.client.request`; budgets: :mod:`eaas.runtime.client.budgets`.

Sampling: one call per forward into :func:`eaas.runtime.client.sampling.sample` over all rows
(logits processors, penalties, greedy / seeded sampling, logprobs); a seeded request draws from
its own ``torch.Generator``, so it is reproducible whatever else is in the batch. A grammar
(:mod:`~eaas.runtime.client.structured`) masks its row first; its sequence stops when complete.

Stops: an EOS token id of the tokenizer/model (unless ``ignore_eos``), a ``stop_token_ids`` id,
``max_tokens`` generated tokens, or one of the ``stop`` strings appearing in the generated text.
Text comes from an :class:`~eaas.runtime.client.detokenizer.IncrementalDetokenizer` per request
(each token decoded once; the stop string is cut and streamed deltas hold back any suffix that
could still become one); ``"length"`` also when the sequence reaches ``max_model_len``.

Failures: an exception in a forward (e.g. :class:`NoLiveReplicaError` from the dispatcher) fails
exactly the requests of that forward with an error event (their blocks are freed); the engine
keeps serving.

:class:`~eaas.runtime.client.reference_engine.ReferenceEngine` keeps the previous engine
(transformers' own forward over a merged left-padded cache) as an exactness oracle for tests.
"""

from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from eaas.runtime import metrics
from eaas.runtime.client import budgets
from eaas.runtime.client.detokenizer import IncrementalDetokenizer
from eaas.runtime.client.kv_cache import PagedKVCache, kv_cache_spec, min_kv_cache_memory
from eaas.runtime.client.model_runner import Chunk, PagedModelRunner
from eaas.runtime.client.overlap import PagedOverlapRunner
from eaas.runtime.client.request import ErrorEvent, Event, GenerationRequest, TokenEvent
from eaas.runtime.client.sampling import (
    SampleOutput,
    SamplingParams,
    make_generator,
    prompt_logprobs,
    sample,
)
from eaas.runtime.client.scheduler import Scheduler, StepCostModel, StepPlan
from eaas.runtime.client.scheduler import Sequence as Seq
from eaas.runtime.client.structured import GrammarState, apply_grammar_masks

log = logging.getLogger("eaas.client.engine")

#: at most one "forward failed" log line per this many seconds; it counts the failures in
#: between (with every replica of an expert down, each engine step fails: ~60 lines per second)
FAIL_LOG_INTERVAL_S = 5.0


class EngineBase:
    """What every engine shares: the request queue, the scheduler thread, sampling and events.

    Subclasses implement :meth:`_enqueue`, :meth:`_step`, :attr:`num_running`, :attr:`num_waiting`.

    Args:
        model: a transformers ``*ForCausalLM`` (local experts or with ``RemoteExperts``), eval mode.
        tokenizer: its tokenizer (used for detokenization and EOS ids).
        client_id: label of this client's metrics.
        max_num_seqs: running sequences at most; further requests wait.
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
        self._inbox: queue.SimpleQueue[GenerationRequest | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.steps = 0
        self.stats = {"prefills": 0, "decode_steps": 0, "max_batch": 0, "cancelled": 0, "failed": 0}
        self._fail_log_at = 0.0  # time.monotonic() from which a failed forward is logged again
        self._fail_quiet = 0  # failed forwards not logged since the last line
        self._running_gauge = metrics.RUNNING_SEQS.labels(client_id=self.client_id)
        self._running_gauge.set(0)
        self._waiting_gauge = metrics.WAITING_SEQS.labels(client_id=self.client_id)
        self._waiting_gauge.set(0)

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
        """Start the scheduler thread. First moves every object alive now (the model, the
        tokenizer, the imported modules: ~430k objects for the tiny DeepSeek-V3 client) out of
        the cyclic garbage collector's reach (``gc.collect(); gc.freeze()``, as vLLM does after
        start-up), so a full collection scans only what serving allocates: over those objects
        one took 320-350 ms here (0 ms after the freeze), a pause every stream sees at once."""
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(
            target=self._loop, name=f"eaas-engine-{self.client_id}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        gc.unfreeze()  # collectable again at exit (nanobind reports frozen objects as leaked)

    def _check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None]
    ) -> GenerationRequest:
        """Queue a request; events arrive on ``on_event`` from the scheduler thread.

        Raises:
            ValueError: empty prompt, ``max_tokens < 1``, or a prompt longer than the engine's
                ``max_model_len``.
        """
        self._check(prompt_ids, params)
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
        raise NotImplementedError

    @property
    def num_waiting(self) -> int:
        raise NotImplementedError

    # ---- scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stopping.is_set():
                try:
                    self._step()
                except Exception:  # never let the scheduler die
                    log.exception("engine step failed")
                    time.sleep(0.05)

    def _step(self) -> None:
        raise NotImplementedError

    def _enqueue(self, req: GenerationRequest) -> None:
        raise NotImplementedError

    def _admit(self, block: bool) -> None:
        """Move submitted requests into the engine's waiting queue (``block``: wait up to 0.5 s)."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                self._enqueue(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail(self, reqs: list[GenerationRequest], exc: BaseException) -> None:
        now = time.monotonic()
        if now >= self._fail_log_at:
            log.warning(
                "forward failed for %d request(s): %s: %s%s",
                len(reqs),
                type(exc).__name__,
                exc,
                f" ({self._fail_quiet} more failed forwards in the last {FAIL_LOG_INTERVAL_S:g} s "
                "not logged)"
                if self._fail_quiet
                else "",
            )
            self._fail_log_at, self._fail_quiet = now + FAIL_LOG_INTERVAL_S, 0
        else:
            self._fail_quiet += 1
        self.stats["failed"] += len(reqs)
        for r in reqs:
            r.finish_reason = "error"
            try:
                r.on_event(ErrorEvent(exc))
            except Exception:  # noqa: BLE001
                log.exception("event callback failed")

    def _sample(self, reqs: list[GenerationRequest], logits: torch.Tensor) -> SampleOutput:
        """One token per request from ``logits`` (``[B, vocab]`` float32), batched.

        Sampling runs on the CPU (its seeded generators are CPU generators, so a seeded request
        draws the same tokens whatever the model's device): device logits are copied over.
        """
        if logits.device.type != "cpu":
            logits = logits.cpu()  # (B, vocab)
        for r in reqs:
            if r._generator is None and r.params.seed is not None and r.params.temperature > 0:
                r._generator = make_generator(r.params.seed)
            if r._grammar is None and r.params.grammar is not None:
                r._grammar = GrammarState(r.params.grammar, self.eos_token_ids)
        if any(r._grammar is not None for r in reqs):
            logits = apply_grammar_masks(logits, [r._grammar for r in reqs])  # (B, vocab)
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
        at_limit: bool = False,
    ) -> bool:
        """Record ``tok``, deliver its event; return True when ``req`` finished.

        ``logprob`` / ``top_logprobs``: from :class:`SampleOutput` when the request asked for them.
        ``at_limit``: the sequence cannot grow further (``max_model_len``): finish with "length".
        """
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
        if len(req.output_ids) <= p.min_tokens:
            # sampling masked these ids; a token drawn anyway (every candidate masked, e.g.
            # stop_token_ids covering the vocabulary) still cannot end the sequence yet
            pass
        elif tok in p.stop_token_ids:
            stop_token, stop_reason = True, tok
        elif not p.ignore_eos and tok in self.eos_token_ids:
            stop_token = True
        g = req._grammar
        if g is not None and (not g.accept(tok) or g.terminated):
            stop_token = True  # grammar complete, or refused a token another stage forced
        length = at_limit or len(req.output_ids) >= p.max_tokens
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
        plp = None
        if len(req.output_ids) == 1 and req.params.prompt_logprobs is not None:
            # a one-token prompt has no position that predicts a prompt token: no forward
            # recorded rows for it, and its only row is the first token's None
            plp = req.prompt_logprobs or [None] * len(req.prompt_ids)
        try:
            req.on_event(TokenEvent(tok, delta, finish, logprob, top_logprobs, stop_reason, plp))
        except Exception:  # noqa: BLE001
            log.exception("event callback failed")
        return finish is not None


class Engine(EngineBase):
    """Continuous-batching engine over a paged KV cache (see the module docstring).

    Args:
        model: a transformers DeepSeek-V3 / Qwen3-MoE / Mixtral ``*ForCausalLM`` (local experts or
            with ``RemoteExperts``), eval mode, on its device (the cache goes there too).
        tokenizer, client_id, max_num_seqs, eos_token_ids: as :class:`EngineBase`.
        kv_cache_memory: KV-cache bytes (``--kv-cache-memory``); ``None``: see
            :func:`~eaas.runtime.client.budgets.default_kv_cache_memory`.
        max_num_batched_tokens: tokens per forward at most (decode tokens plus prefill chunks);
            longer prompts are prefilled in chunks.
        block_size: tokens per KV-cache block.
        max_model_len: longest sequence (prompt + output) in tokens; default the model's
            ``max_position_embeddings``. The cache must hold one such sequence.
        double_batch_overlap: run decode steps as two micro-batches, one's attention while the
            other's MoE round trip is in flight
            (:class:`~eaas.runtime.client.overlap.PagedOverlapRunner`); same greedy tokens.
        prefill_tokens_while_decoding: prefill tokens at most in a step that also decodes
            (``--prefill-tokens-while-decoding``): an int (fixed cap), ``"auto"`` (a mixed step
            costs at most :data:`~eaas.runtime.client.budgets.AUTO_PREFILL_RATIO` decode steps,
            from measured step times: :class:`~eaas.runtime.client.scheduler.StepCostModel`;
            burst steps over the cap within
            :data:`~eaas.runtime.client.budgets.AUTO_BURST_TAIL_SHARE` of the gaps between
            tokens) or ``None`` / ``"off"`` (only ``max_num_batched_tokens``).

    Raises:
        ValueError: a cache budget below one ``max_model_len`` sequence (the message names the
            minimum), or bad sizes.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        client_id: str = "0",
        max_num_seqs: int = 64,
        eos_token_ids: Sequence[int] | None = None,
        kv_cache_memory: int | None = None,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        max_model_len: int | None = None,
        double_batch_overlap: bool = False,
        prefill_tokens_while_decoding: int | str | None = "auto",
    ) -> None:
        cap = budgets.parse_prefill_cap(prefill_tokens_while_decoding)
        super().__init__(
            model,
            tokenizer,
            client_id=client_id,
            max_num_seqs=max_num_seqs,
            eos_token_ids=eos_token_ids,
        )
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        spec = kv_cache_spec(model)
        if kv_cache_memory is None:
            kv_cache_memory = budgets.default_kv_cache_memory(
                spec.bytes_per_token, self.max_model_len, max_num_seqs
            )
        minimum = min_kv_cache_memory(spec, self.max_model_len, block_size)
        if kv_cache_memory < minimum:
            raise ValueError(
                f"--kv-cache-memory {kv_cache_memory} B is below one sequence of max_model_len "
                f"{self.max_model_len} tokens ({minimum} B at {spec.bytes_per_token} B per token)"
            )
        device = next(model.parameters()).device
        self.kv_cache = PagedKVCache(
            spec, kv_cache_memory, block_size=block_size, device=device, client_id=self.client_id
        )
        self.runner: Any = PagedModelRunner(model, self.kv_cache)  # or PagedOverlapRunner
        if double_batch_overlap:
            self.runner = PagedOverlapRunner(self.runner)
        self.scheduler = Scheduler(
            self.kv_cache.allocator,
            block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            watermark_blocks=max(1, self.kv_cache.num_blocks // 100),
            prefill_cap=cap if isinstance(cap, int) else None,
            burst_tail_share=budgets.AUTO_BURST_TAIL_SHARE if cap == "auto" else 0.0,
        )
        # "auto": the cap follows the measured step cost (set before every step)
        # (until a decode step and a prefill step were seen: an eighth of the budget)
        self.step_costs = (
            StepCostModel(
                budgets.AUTO_PREFILL_RATIO,
                floor=block_size,
                large_tokens=max(1, max_num_batched_tokens // 4),
                probe=max(block_size, max_num_batched_tokens // 8),
                noise_budget=budgets.AUTO_NOISE_BUDGET,
            )
            if cap == "auto"
            else None
        )
        self._arrivals = itertools.count()
        self._preempt_counter = metrics.PREEMPTIONS.labels(client_id=self.client_id)
        self.stats.update(
            {
                "preemptions": 0,
                "prefill_chunks": 0,
                "max_step_tokens": 0,
                # most prefill tokens in a step that also decoded (the prefill cap's effect)
                "max_prefill_tokens_while_decoding": 0,
                # steps that went over the cap as burst steps (auto)
                "burst_steps": 0,
            }
        )

    def _check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        super()._check(prompt_ids, params)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}"
            )

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_cache_usage(self) -> dict:
        """``{"blocks_total", "blocks_used", "block_size", "bytes"}`` of the KV cache."""
        return self.kv_cache.usage()

    def _enqueue(self, req: GenerationRequest) -> None:
        gaps = max(0, req.params.max_tokens - 1)
        self.scheduler.add(Seq(req, req.num_tokens, next(self._arrivals), max_gaps=gaps))

    @staticmethod
    def _tokens(req: GenerationRequest, start: int, n: int) -> list[int]:
        lp = len(req.prompt_ids)
        if start + n <= lp:
            return req.prompt_ids[start : start + n]
        if start >= lp:
            return req.output_ids[start - lp : start - lp + n]
        return req.prompt_ids[start:] + req.output_ids[: start + n - lp]

    def _step(self) -> None:
        """One step: schedule, run the forward and sample, postprocess (stats, events)."""
        plan = self._schedule()
        if plan.chunks:
            chunks = self._chunks(plan)
            t0 = time.perf_counter()
            out = self._run(plan, chunks)
            if out is not None:
                self._postprocess(plan, out, t0)
        self._publish()

    def _schedule(self) -> StepPlan:
        """Admit submitted requests, drop cancelled ones, plan the step (sets the auto cap)."""
        sched = self.scheduler
        self._admit(block=not sched.waiting and not sched.running)
        for seq in [s for s in (*sched.running, *sched.waiting) if s.request.cancelled]:
            sched.remove(seq)
            seq.request.finish_reason = "cancelled"
            self.stats["cancelled"] += 1
        if self.step_costs is not None:
            # reference: a decode step of every running and waiting sequence (at most
            # max_num_seqs), the step the median gap between tokens is made of
            batch = min(self.max_num_seqs, len(sched.running) + len(sched.waiting))
            sched.prefill_cap = self.step_costs.cap(batch)
        plan = sched.schedule()
        if plan.preempted:
            self.stats["preemptions"] += len(plan.preempted)
            self._preempt_counter.inc(len(plan.preempted))
        return plan

    def _chunks(self, plan: StepPlan) -> list[Chunk]:
        """The model runner's input: one :class:`Chunk` per scheduled chunk, in plan order."""
        return [
            Chunk(
                self._tokens(c.seq.request, c.start, c.n),
                c.start,
                c.seq.block_table,
                c.samples,
                # positions before the prompt's last one predict prompt tokens
                c.seq.request.params.prompt_logprobs is not None
                and c.start < len(c.seq.request.prompt_ids) - 1,
            )
            for c in plan.chunks
        ]

    def _run(self, plan: StepPlan, chunks: list[Chunk]) -> SampleOutput | None:
        """ONE forward over ``chunks`` and the sampling of every chunk that reaches its end.

        Returns ``None`` when the forward or the sampling raised: every request of the step
        then got its error event and left the scheduler.
        """
        reqs = [c.seq.request for c in plan.chunks if c.samples]
        try:
            logits, full = self.runner.forward_full(chunks)  # (len(reqs), V) float32
            for i, pos_logits in full.items():
                self._prompt_logprobs(plan.chunks[i].seq.request, plan.chunks[i].start, pos_logits)
            return self._sample(reqs, logits)
        except Exception as exc:  # noqa: BLE001
            for c in plan.chunks:
                self.scheduler.remove(c.seq)
            self._fail([c.seq.request for c in plan.chunks], exc)
            return None

    def _postprocess(self, plan: StepPlan, out: SampleOutput, t0: float) -> None:
        """Advance the scheduler, count the step, deliver the sampled tokens; ``t0``: the
        ``time.perf_counter()`` the forward started at (the auto cap's step cost)."""
        sampling = [c for c in plan.chunks if c.samples]  # the rows of ``out``, in order
        sched = self.scheduler
        sched.advance(plan)
        st = self.stats
        st["decode_steps"] += any(c.n == 1 and c.start > 0 for c in plan.chunks)
        st["prefills"] += sum(1 for c in plan.chunks if c.start == 0)
        st["prefill_chunks"] += sum(1 for c in plan.chunks if c.n > 1 or c.start == 0)
        st["max_batch"] = max(st["max_batch"], len(plan.chunks))
        st["max_step_tokens"] = max(st["max_step_tokens"], plan.num_tokens)
        st["burst_steps"] = sched.num_burst_steps
        decodes = sum(1 for c in plan.chunks if c.n == 1 and c.start > 0)
        if decodes:
            st["max_prefill_tokens_while_decoding"] = max(
                st["max_prefill_tokens_while_decoding"], plan.num_tokens - decodes
            )
        for i, c in enumerate(sampling):
            at_limit = c.seq.num_tokens() + 1 >= self.max_model_len
            tok = out.token_ids[i]
            if self._emit(
                c.seq.request, tok, out.logprobs[i], out.top_logprobs[i], at_limit=at_limit
            ):
                sched.remove(c.seq)
        if self.step_costs is not None:  # the whole step: what a streaming client waits for
            self.step_costs.observe(decodes, plan.num_tokens - decodes, time.perf_counter() - t0)
        self.steps += 1

    @staticmethod
    def _prompt_logprobs(req: GenerationRequest, start: int, logits: torch.Tensor) -> None:
        """Record the prompt logprobs of one chunk: ``logits`` ``(n, V)`` after positions
        ``start .. start + n - 1``; position ``p`` predicts prompt token ``p + 1``."""
        prompt = req.prompt_ids
        k = req.params.prompt_logprobs
        assert k is not None
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * len(prompt)
        n = min(logits.shape[0], len(prompt) - 1 - start)  # rows that predict a prompt token
        if n <= 0:
            return
        rows = prompt_logprobs(logits[:n], prompt[start + 1 : start + 1 + n], k)
        req.prompt_logprobs[start + 1 : start + 1 + n] = rows

    def _publish(self) -> None:
        self._running_gauge.set(len(self.scheduler.running))
        self._waiting_gauge.set(len(self.scheduler.waiting))
        self.kv_cache.report()
