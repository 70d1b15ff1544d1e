"""The paged engine's scheduler policy, as pure logic (no model): the token budget, chunked and
batched prefills, preemption order, the decode-aware prefill cap and burst steps, the step cost
model, and ``--prefill-cap`` parsing. The engine running these policies against transformers:
test_engine_paged.py."""

from __future__ import annotations

import pytest

from eaas.runtime.client.kv_cache import BlockAllocator
from eaas.runtime.client.scheduler import Scheduler, Sequence

pytestmark = pytest.mark.engine


# ---- scheduler policy (pure logic) ---------------------------------------------------------
class _Req:
    def __init__(self, prompt: int):
        self.prompt, self.out = prompt, 0


def _seq(req: _Req, arrival: int) -> Sequence:
    return Sequence(req, lambda: req.prompt + req.out, arrival)


def _finish_step(s: Scheduler, plan) -> None:
    s.advance(plan)
    for c in plan.chunks:
        if c.samples:
            c.seq.request.out += 1


def test_scheduler_budget_chunks_and_batched_prefills():
    s = Scheduler(BlockAllocator(100), 4, max_num_seqs=8, max_num_batched_tokens=10)
    a, b, c = _Req(3), _Req(4), _Req(30)
    for i, r in enumerate((a, b, c)):
        s.add(_seq(r, i))
    plan = s.schedule()
    # two whole prompts and the first 3 tokens of the long one, 10 tokens in one step
    assert [(ch.seq.request, ch.start, ch.n) for ch in plan.chunks] == [
        (a, 0, 3),
        (b, 0, 4),
        (c, 0, 3),
    ]
    assert [ch.samples for ch in plan.chunks] == [True, True, False]
    _finish_step(s, plan)
    plan = s.schedule()
    # a and b decode while c's prompt continues in a chunk of the remaining budget
    assert [(ch.seq.request, ch.start, ch.n) for ch in plan.chunks] == [
        (a, 3, 1),
        (b, 4, 1),
        (c, 3, 8),
    ]
    _finish_step(s, plan)
    for _ in range(3):
        plan = s.schedule()
        assert plan.num_tokens <= 10
        assert {ch.seq.request for ch in plan.chunks if ch.n == 1} >= {a, b}  # decode never stalls
        _finish_step(s, plan)
    assert c.out == 1  # 3 + 8 + 8 + 8 + 3 = 30 prompt tokens, then its first token


def test_scheduler_preempts_latest_and_readmits_first():
    # 4 blocks of 2 tokens: a (3 tokens) and b (3 tokens) take 2 blocks each
    alloc = BlockAllocator(4)
    s = Scheduler(alloc, 2, max_num_seqs=4, max_num_batched_tokens=16)
    a, b, c = _Req(3), _Req(3), _Req(2)
    sa, sb, sc = _seq(a, 0), _seq(b, 1), _seq(c, 2)
    for q in (sa, sb, sc):
        s.add(q)
    plan = s.schedule()
    assert [ch.seq for ch in plan.chunks] == [sa, sb]  # c waits: no free block
    _finish_step(s, plan)  # a, b: 3 cached + 1 sampled; position 3 still fits in 2 blocks
    plan = s.schedule()
    assert [(ch.seq, ch.n) for ch in plan.chunks] == [(sa, 1), (sb, 1)] and not plan.preempted
    _finish_step(s, plan)  # position 4 needs a third block each; none is free
    plan = s.schedule()
    assert plan.preempted == [sb]  # the latest admitted gives its blocks to a
    assert [ch.seq for ch in plan.chunks] == [sa]
    assert list(s.waiting) == [sb, sc] and sb.num_computed == 0 and not sb.block_table
    _finish_step(s, plan)
    s.remove(sa)  # a finishes
    plan = s.schedule()
    # b is recomputed first (prompt + its 2 generated tokens), ahead of c
    assert [(ch.seq, ch.start, ch.n) for ch in plan.chunks][0] == (sb, 0, 5)
    assert alloc.num_free + sum(len(q.block_table) for q in s.running) == 4


# ---- decode-aware prefill cap (the ITL tail) -----------------------------------------------
def test_scheduler_caps_prefill_only_in_steps_that_decode():
    s = Scheduler(BlockAllocator(200), 4, max_num_seqs=8, max_num_batched_tokens=20, prefill_cap=5)
    a, b, c = _Req(6), _Req(30), _Req(9)
    s.add(_seq(a, 0))
    plan = s.schedule()
    # nothing decodes yet: the whole budget goes to prefill
    assert [(ch.seq.request, ch.start, ch.n) for ch in plan.chunks] == [(a, 0, 6)]
    _finish_step(s, plan)
    s.add(_seq(b, 1))
    s.add(_seq(c, 2))
    plan = s.schedule()
    # a decodes: b's admission takes at most 5 prefill tokens, c waits for a later step
    assert [(ch.seq.request, ch.start, ch.n) for ch in plan.chunks] == [(a, 6, 1), (b, 0, 5)]
    _finish_step(s, plan)
    plan = s.schedule()
    assert [(ch.seq.request, ch.start, ch.n) for ch in plan.chunks] == [(a, 7, 1), (b, 5, 5)]
    _finish_step(s, plan)
    s.remove(s.running[0])  # a finishes: nothing decodes, b's chunk uses the budget again
    plan = s.schedule()
    assert [(ch.seq.request, ch.start, ch.n) for ch in plan.chunks] == [(b, 10, 20)]
    # the cap can change between steps (the engine's "auto" mode); None = budget only
    _finish_step(s, plan)
    s.prefill_cap = None
    plan = s.schedule()
    assert [(ch.seq.request, ch.start, ch.n) for ch in plan.chunks] == [(b, 30, 1), (c, 0, 9)]
    with pytest.raises(ValueError, match="prefill_cap must be >= 1"):
        Scheduler(BlockAllocator(4), 4, prefill_cap=0)


def _gseq(req: _Req, arrival: int, max_gaps: int) -> Sequence:
    return Sequence(req, lambda: req.prompt + req.out, arrival, max_gaps=max_gaps)


def _plan(plan) -> list[tuple]:
    return [(ch.seq.request, ch.start, ch.n) for ch in plan.chunks]


def _burst_scheduler(**kw) -> Scheduler:
    return Scheduler(
        BlockAllocator(400),
        4,
        max_num_seqs=8,
        max_num_batched_tokens=40,
        prefill_cap=5,
        burst_tail_share=0.005,
        **kw,
    )


def _burst_start(s: Scheduler, gaps: int) -> list[_Req]:
    """a's prompt alone (nothing decodes), then b, c, d wait: 90 prompt tokens > the cap."""
    a, b, c, d = _Req(6), _Req(30), _Req(30), _Req(30)
    s.add(_gseq(a, 0, gaps))
    _finish_step(s, s.schedule())
    for i, r in enumerate((b, c, d), start=1):
        s.add(_gseq(r, i, gaps))
    return [a, b, c, d]


def test_burst_steps_hold_the_decodes_within_the_tail_share():
    """A burst of prompts: the decodes are held and the whole budget goes to prefill while the
    stretched gaps stay within the share; a sequence held over several steps counts once."""
    s = _burst_scheduler()
    a, b, c, d = _burst_start(s, 399)  # 4 x 399 gaps, share 0.005: 7.98 stretched allowed
    plan = s.schedule()
    assert _plan(plan) == [(b, 0, 30), (c, 0, 10)]  # a held
    _finish_step(s, plan)
    plan = s.schedule()  # a still held (counts once), b held now: 2 stretched
    assert _plan(plan) == [(c, 10, 20), (d, 0, 20)]
    _finish_step(s, plan)
    assert [(q.stretched, q.paused_steps) for q in s.running] == [(1, 2), (1, 1), (0, 0), (0, 0)]
    plan = s.schedule()  # 10 tokens left, less than a budget: no burst, a capped mixed step
    assert _plan(plan) == [(a, 6, 1), (b, 30, 1), (c, 30, 1), (d, 20, 5)]
    assert [(q.stretched, q.paused_steps) for q in s.running] == [(1, 0), (1, 0), (0, 0), (0, 0)]
    assert s.num_burst_steps == 2
    _finish_step(s, plan)
    e, f = _Req(60), _Req(60)
    s.add(_gseq(e, 4, 399))
    s.add(_gseq(f, 5, 399))
    # 120 tokens wait, but a, b, c have decoded before: never held (a capped mixed step)
    plan = s.schedule()
    assert _plan(plan) == [(a, 7, 1), (b, 31, 1), (c, 31, 1), (d, 25, 5)]
    assert s.num_burst_steps == 2


def test_burst_steps_end_when_the_share_is_spent_or_a_hold_is_long():
    # 5 x 100 gaps, share 0.005: 2.5 stretched gaps; the third newly held sequence is refused
    s = _burst_scheduler()
    a, b, c, d = _burst_start(s, 100)
    e = _Req(60)
    s.add(_gseq(e, 4, 100))
    _finish_step(s, s.schedule())  # holds a
    _finish_step(s, s.schedule())  # holds b as well (2 <= 2.5)
    plan = s.schedule()  # 70 tokens wait, but c would be the third: a capped mixed step
    assert _plan(plan) == [(a, 6, 1), (b, 30, 1), (c, 30, 1), (d, 20, 5)]
    assert s.num_burst_steps == 2
    # burst_max_steps=1: a is held once, then decodes (the step is capped)
    s = _burst_scheduler(burst_max_steps=1)
    a, b, c, d = _burst_start(s, 399)
    _finish_step(s, s.schedule())
    plan = s.schedule()
    assert _plan(plan) == [(a, 6, 1), (b, 30, 1), (c, 10, 5)]
    with pytest.raises(ValueError, match="burst_max_steps"):
        _burst_scheduler(burst_max_steps=0)


def test_no_burst_step_when_the_prefill_fits_the_cap_or_the_share_is_zero():
    s = Scheduler(
        BlockAllocator(400), 4, max_num_batched_tokens=40, prefill_cap=8, burst_tail_share=0.009
    )
    a, b = _Req(6), _Req(4)
    s.add(_gseq(a, 0, 999))
    _finish_step(s, s.schedule())
    s.add(_gseq(b, 1, 999))
    plan = s.schedule()  # b's 4 tokens fit under the cap: nobody is held
    assert _plan(plan) == [(a, 6, 1), (b, 0, 4)]
    assert s.running[0].stretched == 0 and s.num_burst_steps == 0
    # share 0 (the default; a fixed --prefill-tokens-while-decoding N): the cap always holds
    s0 = Scheduler(BlockAllocator(400), 4, max_num_batched_tokens=40, prefill_cap=5)
    a, b = _Req(6), _Req(30)
    s0.add(_gseq(a, 0, 10**6))
    _finish_step(s0, s0.schedule())
    s0.add(_gseq(b, 1, 10**6))
    assert _plan(s0.schedule()) == [(a, 6, 1), (b, 0, 5)]
    # unknown max_gaps (0) allow nothing
    s1 = _burst_scheduler()
    a, b = _Req(6), _Req(30)
    s1.add(_gseq(a, 0, 0))
    _finish_step(s1, s1.schedule())
    s1.add(_gseq(b, 1, 0))
    assert _plan(s1.schedule()) == [(a, 6, 1), (b, 0, 5)]
    for bad in (-0.001, 0.01, 0.5):
        with pytest.raises(ValueError, match="burst_tail_share must be in"):
            Scheduler(BlockAllocator(4), 4, burst_tail_share=bad)


def test_burst_step_allowed():
    from eaas.runtime.client.scheduler import burst_step_allowed

    assert burst_step_allowed(0, 4064, 9, 0.005)  # W1's step 2 holds 9: 9 <= 20.3
    assert burst_step_allowed(9, 4064, 9, 0.005)  # step 3 holds 9 more: 18 <= 20.3
    assert not burst_step_allowed(18, 4064, 9, 0.005)  # step 4: 27 > 20.3
    assert burst_step_allowed(18, 4064, 0, 0.005)  # holding the same ones longer: free
    assert not burst_step_allowed(0, 10**6, 1, 0.0)  # share 0: never


def test_step_cost_model_estimates_decode_step_and_prefill_token_costs():
    from eaas.runtime.client.scheduler import StepCostModel, prefill_cap_for

    def t(decodes, prefill):  # the machine: 10 ms per step, 0.5 ms per decode, 0.1 per prefill
        return 0.010 + 5e-4 * decodes + 1e-4 * prefill

    m = StepCostModel(ratio=3.0, floor=16, large_tokens=512, probe=256)
    assert m.estimate() is None and m.cap() == 256  # nothing seen: the probe
    for _ in range(5):
        m.observe(8, 0, t(8, 0))  # decode steps only: no per-token cost yet
    assert m.estimate() is None and m.cap() == 256
    m.observe(4, 100, t(4, 100))  # a mixed step under the cap: not observed
    assert m.estimate() is None
    m.observe(0, 2048, t(0, 2048))  # a prefill step
    t_dec, per_token = m.estimate()
    assert t_dec == pytest.approx(t(8, 0))
    assert per_token == pytest.approx((t(0, 2048) - t(8, 0)) / (2048 - 8))
    # a mixed step of the measured batch plus the cap costs about 3 decode steps at most (the
    # slope between the classes blends decode and prefill tokens: within a few percent here)
    cap = m.cap()
    assert cap == int(2 * t_dec / per_token)
    assert 2.9 * t(8, 0) <= t(8, cap) <= 3.05 * t(8, 0)
    # a larger reference batch: the decode step is at least per_token more per sequence
    assert m.cap(32) == int(2 * (t_dec + 24 * per_token) / per_token)
    assert m.cap(4) == cap  # never below what was measured
    # recent steps weigh more: after a slowdown the estimate follows the new costs
    for _ in range(30):
        m.observe(8, 0, 4 * t(8, 0))
        m.observe(0, 2048, 4 * t(0, 2048))
    assert m.estimate()[0] == pytest.approx(4 * t(8, 0), rel=1e-2)
    assert m.cap() == pytest.approx(cap, abs=2)  # both 4x slower: the same cap
    assert StepCostModel().cap() is None  # no probe: no cap
    assert prefill_cap_for(0.0, 1e-3, 2.0, 16) == 16  # the floor
    assert prefill_cap_for(0.02, 1e-4, 3.0, 16) == 400
    with pytest.raises(ValueError, match="ratio must be > 1"):
        StepCostModel(ratio=1.0)
    with pytest.raises(ValueError, match="prefill_token_s must be > 0"):
        prefill_cap_for(0.01, 0.0, 2.0, 16)


def test_step_cost_model_lowers_the_ratio_on_a_noisy_machine():
    from eaas.runtime.client.scheduler import StepCostModel

    def t(decodes, prefill):  # 10 ms per step, 0.5 ms per decode, 0.1 ms per prefill token
        return 0.010 + 5e-4 * decodes + 1e-4 * prefill

    def model(**kw):
        m = StepCostModel(ratio=2.0, floor=1, large_tokens=512, window=16, **kw)
        m.observe(8, 0, t(8, 0))
        m.observe(0, 2048, t(0, 2048))
        return m

    quiet, noisy, off = model(noise_budget=2.55), model(noise_budget=2.55), model()
    assert quiet.noise() is None and quiet.effective_ratio() == 2.0  # no residuals yet
    for i in range(16):
        quiet.observe(8, 0, t(8, 0) * (1.1 if i % 2 else 0.95))
        # every 4th decode step takes 2x: the 90th percentile of the residuals is ~2
        slow = 2.0 if i % 4 == 3 else 1.0
        noisy.observe(8, 0, t(8, 0) * slow)
        off.observe(8, 0, t(8, 0) * slow)
    assert quiet.noise() == pytest.approx(1.1, rel=0.05)
    assert quiet.effective_ratio() == 2.0  # 2.55 / 1.1 > 2: the ratio stays
    assert noisy.noise() > 1.5
    assert noisy.effective_ratio() == pytest.approx(2.55 / noisy.noise())
    assert 1.25 <= noisy.effective_ratio() < 2.0
    assert noisy.cap() < quiet.cap()  # a smaller cap on the noisy machine
    assert off.effective_ratio() == 2.0  # no noise budget: the ratio is fixed
    for i in range(16):  # a very noisy machine: not below min_ratio
        noisy.observe(8, 0, t(8, 0) * (5.0 if i % 2 else 1.0))
    assert noisy.effective_ratio() == 1.25
    with pytest.raises(ValueError, match="min_ratio"):
        StepCostModel(ratio=2.0, min_ratio=3.0)
    with pytest.raises(ValueError, match="noise_quantile"):
        StepCostModel(noise_quantile=1.0)


@pytest.mark.parametrize(
    "value,expected",
    [("auto", "auto"), ("off", None), (None, None), ("64", 64), (64, 64)],
)
def test_parse_prefill_cap(value, expected):
    from eaas.runtime.client.budgets import parse_prefill_cap

    assert parse_prefill_cap(value) == expected


@pytest.mark.parametrize("value", ["0", "-3", "lots", "1.5", 0])
def test_parse_prefill_cap_rejects_bad_values(value):
    from eaas.runtime.client.budgets import parse_prefill_cap

    with pytest.raises(ValueError, match="--prefill-tokens-while-decoding must be auto, off"):
        parse_prefill_cap(value)
