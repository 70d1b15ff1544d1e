"""Step scheduler of the attention client: which tokens of which sequences go into the next forward.

Pure bookkeeping (no tensors, no model): sequences, the waiting and running queues, the token
budget and the KV-cache blocks (through :class:`~eaas.runtime.client.kv_cache.BlockAllocator`).
The policy follows vLLM's V1 scheduler (chunked prefill, recompute preemption):

1. **Running sequences first**, in admission order: first every sequence whose tokens are all
   cached but the last sampled one (*decode*, 1 token), then every sequence still prefilling (its
   next chunk, ``min(remaining, budget left)`` tokens), so a long prompt never takes the budget of
   the decoding sequences. All of them go into ONE forward.
2. A decode that needs a new block when none is free **preempts** the most recently admitted
   running sequence (its blocks are freed, it returns to the head of the waiting queue and is
   recomputed later: its prompt plus everything it generated is prefilled again, so generation
   continues where it stopped). If that sequence is the one asking, it preempts itself.
3. **Admission** (first come, first served): while the token budget, ``max_num_seqs`` and the free
   blocks allow, the head of the waiting queue is admitted with blocks for all its tokens (prompt
   plus tokens generated before a preemption) and gets its first chunk. Nothing is admitted in a
   step that preempted.

The token budget (``max_num_batched_tokens``) bounds a step's tokens, so a long prompt is
prefilled in chunks over several steps while the running sequences keep decoding, and a cancelled
request stops within one chunk.

**Decode-aware prefill cap** (the ITL tail): in a step that also decodes, prefill tokens (chunks
of running sequences and new admissions together) are capped at :attr:`Scheduler.prefill_cap`
(``None``: only the token budget), so a decode step that shares its forward with prefill costs a
bounded multiple of a plain decode step instead of a whole ``max_num_batched_tokens`` forward.
The cap is either fixed (``--prefill-tokens-while-decoding N``) or set every step by the engine
from measured step times (:class:`StepCostModel`, ``auto``): with a plain decode step taking
``t_d`` and a prefill token ``c_p`` more, a step that adds ``P`` prefill tokens to its decodes
stays within ``ratio`` decode steps when ``P <= (ratio - 1) * t_d / c_p``. Steps without
decodes use the whole budget (the first prompts of a burst are prefilled at full speed). This is vLLM's
``--long-prefill-token-threshold`` idea (a long prompt's chunk is capped so it does not stall
decoding) applied to the step's prefill tokens as a whole.

**Burst steps** (``burst_tail_share``, ``auto`` only): an ITL p99 lets 1% of the gaps between
tokens be long. When a burst of prompts waits (at least ``max_num_batched_tokens`` prompt
tokens, more than one step takes) and every decoding sequence has only its first token (the
first prompts of the burst; a sequence that has decoded before is never held, so a long prompt
or a prompt arriving while others decode is a capped mixed step, never a stall), a step may hold
the decodes and give the whole budget to prefill (as vLLM V0's scheduler did, prefill first),
as long as the gaps that holding stretched among the live (running and waiting) sequences stay
within ``burst_tail_share`` of all the gaps those sequences will have (``Sequence.max_gaps``:
``max_tokens - 1`` each; :func:`burst_step_allowed`). A sequence held over several steps in a
row has ONE long gap, so it counts once; it is held ``burst_max_steps`` in a row at most. A burst
(32 prompts of 220 tokens at once, 128 output tokens, budget 2048, share 0.005): step 1
prefills 9 prompts, step 2 holds those 9 (9 <= 0.005 * 32 * 127 = 20.3) and prefills 9 more,
step 3 holds 18 (9 newly: 18 <= 20.3) and prefills 9 more, step 4 would hold 9 more (27 > 20.3)
and is a capped mixed step instead: 27 of 4064 gaps (0.7%) are long, the rest of the burst is
prefilled at full speed with no mixed steps. Requests that stop before ``max_tokens`` have fewer
gaps than counted, so the share is an upper bound only for those that run to the end.
The KV cache must hold at least one sequence of the longest
allowed length (checked by the engine at start-up), so a lone sequence always fits and nothing
ever runs out of memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eaas.runtime.client.kv_cache import BlockAllocator

if TYPE_CHECKING:  # annotations only: the scheduler never reads a request
    from eaas.runtime.client.request import GenerationRequest


@dataclass(eq=False)
class Sequence:
    """Scheduler state of one request.

    Attributes:
        request: the engine's request (carried, never read here).
        num_tokens: callable giving the sequence's current length (prompt + generated tokens).
        block_table: KV-cache block ids, in position order.
        num_computed: leading tokens whose keys/values are in the cache.
        arrival: admission-order key (FCFS; preempted sequences keep theirs).
        max_gaps: gaps between its tokens at most (``max_tokens - 1``; 0: unknown), the
            denominator of the burst tail share.
        stretched: its gaps that burst steps stretched (one per pause, however long).
        paused_steps: burst steps it has been held for since its last token.
        decodes: decode steps it has been in; only a sequence with none can be held.
    """

    request: GenerationRequest
    num_tokens: Callable[[], int]
    arrival: int
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    preemptions: int = 0
    #: gaps between tokens the sequence will have at most (``max_tokens - 1``; 0: unknown)
    max_gaps: int = 0
    #: its gaps that burst steps stretched (:attr:`Scheduler.burst_tail_share`)
    stretched: int = 0
    #: burst steps it has been paused for since its last token (0: not paused)
    paused_steps: int = 0
    #: decode steps it has been in (0: it has only the token its prefill sampled)
    decodes: int = 0


@dataclass
class ScheduledChunk:
    """Tokens ``start .. start + n - 1`` of ``seq`` go into this step's forward.

    ``samples`` is True when the chunk reaches the end of the sequence, so the step samples a
    next token for it from the chunk's last position.
    """

    seq: Sequence
    start: int
    n: int

    @property
    def samples(self) -> bool:
        return self.start + self.n == self.seq.num_tokens()


@dataclass
class StepPlan:
    """The result of :meth:`Scheduler.schedule`."""

    chunks: list[ScheduledChunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.n for c in self.chunks)


class Scheduler:
    """Waiting/running queues, token budget, KV-cache blocks.

    Args:
        allocator: the KV cache's block allocator.
        block_size: tokens per block.
        max_num_seqs: running sequences at most.
        max_num_batched_tokens: tokens per forward at most (decode tokens + prefill chunks).
        watermark_blocks: free blocks admission leaves for running sequences to grow into.
        prefill_cap: prefill tokens at most in a step that also decodes (``None``: only the
            token budget); the engine may change it between steps.
        burst_tail_share: share (``0 <= share < 0.01``) of the live sequences' gaps that
            burst steps may stretch (0: never; see the module docstring).
        burst_max_steps: a sequence is held for this many burst steps in a row at most.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        watermark_blocks: int = 0,
        prefill_cap: int | None = None,
        burst_tail_share: float = 0.0,
        burst_max_steps: int = 4,
    ):
        if prefill_cap is not None and prefill_cap < 1:
            raise ValueError(f"prefill_cap must be >= 1 or None, got {prefill_cap}")
        if not 0.0 <= burst_tail_share < 0.01:
            raise ValueError(f"burst_tail_share must be in [0, 0.01), got {burst_tail_share}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks
        #: prefill tokens at most in a step that also decodes (None: only the token budget);
        #: the engine may change it between steps (StepCostModel)
        self.prefill_cap = prefill_cap
        if burst_max_steps < 1:
            raise ValueError(f"burst_max_steps must be >= 1, got {burst_max_steps}")
        self.burst_tail_share = float(burst_tail_share)
        self.burst_max_steps = int(burst_max_steps)
        #: steps that went over the prefill cap on the burst tail share (a statistic)
        self.num_burst_steps = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def _blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (tail of the waiting queue)."""
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` (finished, cancelled or failed) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []
        seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.preemptions += 1
        self.num_preemptions += 1
        # head of the waiting queue, keeping arrival order among preempted sequences
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < seq.arrival:
            i += 1
        self.waiting.insert(i, seq)

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        need = self._blocks_for(tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def schedule(self) -> StepPlan:
        """Plan the next step (see the module docstring); allocates and frees blocks."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        scheduled: set[int] = set()
        # decodes first, then the prefill chunks of running sequences: a long prompt being
        # prefilled never takes the budget of the sequences that are decoding
        decoding = [q for q in self.running if q.num_tokens() - q.num_computed == 1]
        prefilling = [q for q in self.running if q.num_tokens() - q.num_computed > 1]
        cap = self.prefill_cap
        burst = self._burst_allowed(decoding, prefilling)
        if burst:  # decodes held, the whole budget to prefill (see the module docstring)
            cap = None
            self.num_burst_steps += 1
            for q in decoding:
                q.stretched += q.paused_steps == 0
                q.paused_steps += 1
        prefill_budget: int | None = None  # set once the decodes are planned
        for seq in prefilling if burst else decoding + prefilling:
            if prefill_budget is None and seq.num_tokens() - seq.num_computed > 1:
                prefill_budget = self._prefill_budget(budget, bool(chunks), cap)
            left = budget if prefill_budget is None else prefill_budget
            if left <= 0:
                break
            if seq not in self.running:  # preempted earlier in this step
                continue
            n = min(seq.num_tokens() - seq.num_computed, left)
            ok = self._grow(seq, seq.num_computed + n)
            while not ok:
                victim = self.running[-1]
                if id(victim) in scheduled:  # never preempt what is already in this step
                    victim = seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                ok = self._grow(seq, seq.num_computed + n)
            if not ok:
                continue
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            scheduled.add(id(seq))
            budget -= n
            if prefill_budget is not None:
                prefill_budget -= n
        if prefill_budget is None:
            prefill_budget = self._prefill_budget(budget, bool(chunks), cap)
        if not preempted:
            while (
                self.waiting
                and budget > 0
                and prefill_budget > 0
                and len(self.running) < self.max_num_seqs
            ):
                seq = self.waiting[0]
                total = seq.num_tokens()
                need = self._blocks_for(total)
                # a lone sequence is always admitted (the cache holds one of maximal length)
                reserve = self.watermark_blocks if self.running else 0
                if need + reserve > self.allocator.num_free:
                    break
                self.waiting.popleft()
                seq.block_table = self.allocator.allocate(need)
                seq.num_computed = 0
                self.running.append(seq)
                n = min(total, budget, prefill_budget)
                chunks.append(ScheduledChunk(seq, 0, n))
                budget -= n
                prefill_budget -= n
        for c in chunks:  # a sequence in this step is no longer held
            c.seq.paused_steps = 0
            if c.n == 1 and c.start > 0 and c.seq.num_tokens() - c.start == 1:
                c.seq.decodes += 1
        return StepPlan(chunks, preempted)

    def _burst_allowed(self, decoding: list[Sequence], prefilling: list[Sequence]) -> bool:
        """Whether this step holds the decodes and gives the whole budget to prefill: only when
        sequences decode, every one of them has only its first token (a sequence that has
        decoded before is never held: a long prompt never stalls running streams), at least a
        whole budget of prompt tokens waits and can start, no sequence has been held
        ``burst_max_steps`` in a row, and the live sequences' stretched
        gaps, the newly held ones included, stay within :attr:`burst_tail_share` of all their
        gaps (:func:`burst_step_allowed`)."""
        cap = self.prefill_cap
        if self.burst_tail_share <= 0 or cap is None or not decoding:
            return False
        if any(q.paused_steps >= self.burst_max_steps or q.decodes for q in decoding):
            return False
        pending = sum(q.num_tokens() - q.num_computed for q in prefilling)
        if self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            need = self._blocks_for(head.num_tokens()) + self.watermark_blocks
            if need <= self.allocator.num_free:
                pending += sum(q.num_tokens() for q in self.waiting)
        # a burst: more prompt tokens wait than one step takes (one prompt arriving while others
        # decode, the steady state, is a capped mixed step: the live set turns over there, and
        # a share counted over the live sequences would allow a hold again and again)
        if pending < self.max_num_batched_tokens:
            return False
        live = (*self.running, *self.waiting)
        return burst_step_allowed(
            sum(q.stretched for q in live),
            sum(q.max_gaps for q in live),
            sum(1 for q in decoding if q.paused_steps == 0),
            self.burst_tail_share,
        )

    @staticmethod
    def _prefill_budget(budget: int, decodes: bool, cap: int | None) -> int:
        """Prefill tokens this step may still take: the token budget left, capped at ``cap``
        when the step decodes."""
        if decodes and cap is not None:
            return min(budget, cap)
        return budget

    def advance(self, plan: StepPlan) -> None:
        """Record that ``plan``'s forward succeeded: its chunks' tokens are now cached."""
        for c in plan.chunks:
            c.seq.num_computed = c.start + c.n


def burst_step_allowed(stretched: int, total_gaps: int, newly_held: int, share: float) -> bool:
    """Whether one more burst step may hold ``newly_held`` more sequences: ``stretched +
    newly_held <= share * total_gaps`` (and ``share > 0``).

    Args:
        stretched: gaps of the live sequences already stretched by burst steps (a sequence
            held over several steps in a row counts once).
        total_gaps: gaps the live sequences have at most (sum of ``max_tokens - 1``).
        newly_held: decoding sequences the step holds that the previous step did not.
        share: the allowed share of stretched gaps (``0`` never allows one).
    """
    return share > 0 and stretched + newly_held <= share * total_gaps


def prefill_cap_for(decode_step_s: float, prefill_token_s: float, ratio: float, floor: int) -> int:
    """Prefill tokens a step may add to its decodes so that it costs at most ``ratio`` decode
    steps: ``(ratio - 1) * decode_step_s / prefill_token_s``, at least ``floor``.

    Args:
        decode_step_s: wall time of a plain decode step (seconds), >= 0.
        prefill_token_s: marginal wall time of one prefill token (seconds), > 0.
        ratio: allowed cost of a mixed step over a decode step (> 1).
        floor: least cap (progress for prompts even where the estimate says 0).

    Raises:
        ValueError: ``prefill_token_s <= 0`` or ``ratio <= 1``.
    """
    if prefill_token_s <= 0:
        raise ValueError(f"prefill_token_s must be > 0, got {prefill_token_s}")
    if ratio <= 1:
        raise ValueError(f"ratio must be > 1, got {ratio}")
    return max(int(floor), int((ratio - 1) * max(decode_step_s, 0.0) / prefill_token_s))


class StepCostModel:
    """Online estimate of what a decode step and a prefill token cost, for the decode-aware
    prefill cap (``--prefill-tokens-while-decoding auto``).

    Two classes of steps, each with an exponentially weighted mean of its token count and wall
    time (weight ``decay`` kept per observation, so the estimate follows a changing machine
    load): *decode steps* (decode tokens only) and *prefill steps* (at least ``large_tokens``
    prefill tokens). The decode step's mean time is the reference; the slope between the two
    means is the marginal cost of a token. Mixed steps under the cap are not observed (they sit
    between the two and would only blur the slope). Two well separated points make the estimate
    robust to the noise of a shared machine. Until both classes have a step (or when the slope is
    not positive) :meth:`cap` answers ``probe``. The engine's steps persist over requests, so a
    burst of new prompts is capped from what earlier traffic (a warm-up) measured.

    **Noise** (``noise_budget``): a mixed step's cost is a multiple of the mean decode step, but
    the ITL tail is an upper quantile, and on a shared machine the same step takes 1.2-2x its
    mean now and then. The model keeps the last ``window`` decode steps' *residuals* (wall time
    / the estimate's time for their batch) and, once it has ``window // 4`` of them, lowers the
    ratio to ``noise_budget / q`` (at least ``min_ratio``), ``q`` being their
    ``noise_quantile`` (at least 1): a mixed step at its upper quantile then costs about
    ``noise_budget`` mean decode steps. On a quiet machine (``q`` ~1.2) the ratio stays at
    ``ratio``.

    Args:
        ratio: a mixed step may cost this many decode steps at most (default 2).
        floor: least cap in tokens (default 16).
        large_tokens: a step with at least this many prefill tokens is a prefill step
            (default 256).
        decay: weight kept per observation of a class (default 0.8).
        probe: the cap while the estimate is undetermined (``None``: no cap).
        noise_budget: a mixed step's cost at the residuals' ``noise_quantile``, in mean decode
            steps (``None``: no noise correction, always ``ratio``).
        min_ratio: the ratio the noise correction goes down to at most (default 1.25).
        noise_quantile: the residuals' quantile, in ``(0, 1)`` (default 0.9).
        window: decode steps whose residuals are kept (default 64).
    """

    def __init__(
        self,
        ratio: float = 2.0,
        floor: int = 16,
        large_tokens: int = 256,
        decay: float = 0.8,
        probe: int | None = None,
        noise_budget: float | None = None,
        min_ratio: float = 1.25,
        noise_quantile: float = 0.9,
        window: int = 64,
    ):
        if ratio <= 1:
            raise ValueError(f"ratio must be > 1, got {ratio}")
        if not 1 < min_ratio <= ratio:
            raise ValueError(f"min_ratio must be in (1, ratio], got {min_ratio}")
        if not 0 < noise_quantile < 1:
            raise ValueError(f"noise_quantile must be in (0, 1), got {noise_quantile}")
        if large_tokens < 1:
            raise ValueError(f"large_tokens must be >= 1, got {large_tokens}")
        if window < 4:
            raise ValueError(f"window must be >= 4, got {window}")
        self.ratio, self.floor, self.decay = float(ratio), int(floor), float(decay)
        self.large_tokens = int(large_tokens)
        self.probe = probe
        self.noise_budget = noise_budget
        self.min_ratio, self.noise_quantile = float(min_ratio), float(noise_quantile)
        self._residuals: deque[float] = deque(maxlen=int(window))
        # per class: [weight, weighted tokens, weighted seconds]
        self._decode = [0.0, 0.0, 0.0]
        self._prefill = [0.0, 0.0, 0.0]

    def observe(self, decodes: int, prefill: int, seconds: float) -> None:
        """Record one forward with ``decodes`` decode and ``prefill`` prefill tokens that took
        ``seconds`` (wall time). Mixed steps below ``large_tokens`` prefill tokens are ignored."""
        if prefill == 0 and decodes > 0:
            acc = self._decode
            e = self.estimate()
            if e is not None:  # the residual against the estimate before this step
                t_dec, per_token = e
                seen = self._decode[1] / self._decode[0]
                predicted = t_dec + (decodes - seen) * per_token
                if predicted > 0:
                    self._residuals.append(float(seconds) / predicted)
        elif prefill >= self.large_tokens:
            acc = self._prefill
        else:
            return
        d = self.decay
        acc[0] = d * acc[0] + 1.0
        acc[1] = d * acc[1] + float(decodes + prefill)
        acc[2] = d * acc[2] + float(seconds)

    def estimate(self) -> tuple[float, float] | None:
        """``(decode step seconds, seconds per prefill token)``, or ``None`` while a class has
        no step yet or the slope is not positive."""
        (wd, nd, td), (wp, np_, tp) = self._decode, self._prefill
        if wd <= 0 or wp <= 0:
            return None
        nd, td, np_, tp = nd / wd, td / wd, np_ / wp, tp / wp
        if np_ <= nd:
            return None
        per_token = (tp - td) / (np_ - nd)
        if per_token <= 0:
            return None
        return td, per_token

    def cap(self, batch: int | None = None) -> int | None:
        """Prefill cap for a step that decodes (:func:`prefill_cap_for`), or ``probe`` while
        the estimate is undetermined.

        Args:
            batch: sequences the reference decode step has (default: as many as the decode
                steps seen had on average); a larger batch than measured adds the marginal
                token cost per extra sequence (a lower bound of a decode token's cost).
        """
        e = self.estimate()
        if e is None:
            return self.probe
        t_dec, per_token = e
        if batch is not None:
            seen = self._decode[1] / self._decode[0]
            t_dec += max(0.0, batch - seen) * per_token
        return prefill_cap_for(t_dec, per_token, self.effective_ratio(), self.floor)

    def noise(self) -> float | None:
        """The ``noise_quantile`` of the kept decode-step residuals, at least 1 (``None`` while
        fewer than ``window // 4`` are kept)."""
        r = self._residuals
        if len(r) < max(1, (r.maxlen or 4) // 4):
            return None
        xs = sorted(r)
        return max(1.0, xs[min(len(xs) - 1, int(self.noise_quantile * len(xs)))])

    def effective_ratio(self) -> float:
        """``ratio``, or ``noise_budget / noise()`` clamped to ``[min_ratio, ratio]``."""
        q = self.noise() if self.noise_budget is not None else None
        if q is None or self.noise_budget is None:
            return self.ratio
        return min(self.ratio, max(self.min_ratio, self.noise_budget / q))


__all__ = [
    "Scheduler",
    "ScheduledChunk",
    "Sequence",
    "StepCostModel",
    "StepPlan",
    "burst_step_allowed",
    "prefill_cap_for",
]
