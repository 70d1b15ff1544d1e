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
from measured step times (:class:`StepCostModel`, ``auto``): with a step costing
``t(n) = c0 + c1 * n`` for ``n`` tokens, a step of ``B`` decodes plus ``P`` prefill tokens stays
within ``ratio`` times the decode step when ``P <= (ratio - 1) * (c0 / c1 + B)``. Steps without
decodes use the whole budget (a burst of new prompts is prefilled at full speed). This is vLLM's
``--long-prefill-token-threshold`` idea (a long prompt's chunk is capped so it does not stall
decoding) applied to the step's prefill tokens as a whole. The KV cache must hold at least one sequence of the longest
allowed length (checked by the engine at start-up), so a lone sequence always fits and nothing
ever runs out of memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from eaas.runtime.client.kv_cache import BlockAllocator

if TYPE_CHECKING:  # the engine imports this module: no runtime import back
    from eaas.runtime.client.engine import GenerationRequest


@dataclass(eq=False)
class Sequence:
    """Scheduler state of one request.

    Attributes:
        request: the engine's request (carried, never read here).
        num_tokens: callable giving the sequence's current length (prompt + generated tokens).
        block_table: KV-cache block ids, in position order.
        num_computed: leading tokens whose keys/values are in the cache.
        arrival: admission-order key (FCFS; preempted sequences keep theirs).
    """

    request: GenerationRequest
    num_tokens: Callable[[], int]
    arrival: int
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    preemptions: int = 0


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
    ):
        if prefill_cap is not None and prefill_cap < 1:
            raise ValueError(f"prefill_cap must be >= 1 or None, got {prefill_cap}")
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
        prefill_budget: int | None = None  # set once the decodes are planned
        for seq in decoding + prefilling:
            if prefill_budget is None and seq.num_tokens() - seq.num_computed > 1:
                prefill_budget = self._prefill_budget(budget, decodes=bool(chunks))
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
            prefill_budget = self._prefill_budget(budget, decodes=bool(chunks))
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
        return StepPlan(chunks, preempted)

    def _prefill_budget(self, budget: int, decodes: bool) -> int:
        """Prefill tokens this step may still take: the token budget left, capped at
        :attr:`prefill_cap` when the step decodes."""
        if decodes and self.prefill_cap is not None:
            return min(budget, self.prefill_cap)
        return budget

    def advance(self, plan: StepPlan) -> None:
        """Record that ``plan``'s forward succeeded: its chunks' tokens are now cached."""
        for c in plan.chunks:
            c.seq.num_computed = c.start + c.n


def prefill_cap_for(c0: float, c1: float, decodes: int, ratio: float, floor: int) -> int:
    """Prefill tokens a step with ``decodes`` decode tokens may add so that it costs at most
    ``ratio`` times the plain decode step, under the linear step cost ``t(n) = c0 + c1 * n``:
    ``(ratio - 1) * (c0 / c1 + decodes)``, at least ``floor``.

    Args:
        c0: fixed cost of a step (seconds; Python work, layer round trips), >= 0.
        c1: cost per token (seconds), > 0.
        decodes: decode tokens in the step.
        ratio: allowed cost of a mixed step over a decode step (> 1).
        floor: least cap (progress for prompts even where the model says 0).

    Raises:
        ValueError: ``c1 <= 0`` or ``ratio <= 1``.
    """
    if c1 <= 0:
        raise ValueError(f"c1 must be > 0, got {c1}")
    if ratio <= 1:
        raise ValueError(f"ratio must be > 1, got {ratio}")
    return max(int(floor), int((ratio - 1) * (max(c0, 0.0) / c1 + decodes)))


class StepCostModel:
    """Online fit of a forward's wall time as ``t(n) = c0 + c1 * n`` (``n`` tokens in the step),
    for the decode-aware prefill cap (``--prefill-tokens-while-decoding auto``).

    Exponentially weighted least squares over recent steps (weight ``decay`` per step, so the
    fit follows a changing machine load); a fit needs steps of different sizes (a decode step
    and a prefill step, say): until then :meth:`cap` is ``None`` (no cap).

    Args:
        ratio: a mixed step may cost this many decode steps (default 2).
        floor: least cap in tokens (default 16).
        decay: weight kept per step (default 0.9).
    """

    def __init__(self, ratio: float = 2.0, floor: int = 16, decay: float = 0.9):
        if ratio <= 1:
            raise ValueError(f"ratio must be > 1, got {ratio}")
        self.ratio, self.floor, self.decay = float(ratio), int(floor), float(decay)
        self._s = [0.0] * 5  # weighted sums: 1, n, t, n*n, n*t

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one forward of ``tokens`` tokens that took ``seconds`` (wall time)."""
        d, n, t = self.decay, float(tokens), float(seconds)
        s = self._s
        for i, v in enumerate((1.0, n, t, n * n, n * t)):
            s[i] = d * s[i] + v

    def fit(self) -> tuple[float, float] | None:
        """``(c0, c1)`` seconds, or ``None`` while the steps seen do not determine them (one
        size only) or give a non-positive per-token cost."""
        w, sn, st, snn, snt = self._s
        den = w * snn - sn * sn
        if w <= 0 or den <= 1e-9 * max(1.0, w * snn):  # all steps (nearly) the same size
            return None
        c1 = (w * snt - sn * st) / den
        if c1 <= 0:
            return None
        return (st - c1 * sn) / w, c1

    def cap(self, decodes: int) -> int | None:
        """Prefill cap for a step with ``decodes`` decode tokens (:func:`prefill_cap_for`), or
        ``None`` (no cap) while the fit is undetermined."""
        f = self.fit()
        if f is None:
            return None
        return prefill_cap_for(f[0], f[1], decodes, self.ratio, self.floor)


__all__ = [
    "Scheduler",
    "ScheduledChunk",
    "Sequence",
    "StepCostModel",
    "StepPlan",
    "prefill_cap_for",
]
