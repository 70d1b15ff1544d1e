"""Paged engine: exactness against transformers for all three architectures, with chunked and
batched prefill and with preemption forced; the KV cache manager; the scheduler's policy.

Ground truth: transformers' ``generate`` (greedy, fp32, one prompt at a time) and its forward's
logits; the previous engine (:class:`ReferenceEngine`, transformers' forward over a merged cache)
for seeded sampling. Local experts only (the disaggregated path is covered in tests/e2e).
"""

from __future__ import annotations

import threading

import pytest
import torch

from eaas.runtime.client.engine import Engine, ErrorEvent, SamplingParams
from eaas.runtime.client.kv_cache import (
    BlockAllocator,
    PagedKVCache,
    kv_cache_spec,
    parse_memory_size,
)
from eaas.runtime.client.model_runner import Chunk, PagedModelRunner
from eaas.runtime.client.reference_engine import ReferenceEngine
from eaas.runtime.client.scheduler import Scheduler, Sequence
from eaas.runtime.models.attention import load_attention_model
from eaas.runtime.models.reference import reference_generate, reference_logits

from helpers.common import wait_until
from helpers.engine import ENGINE_TEXTS as TEXTS
from helpers.engine import run_requests

pytestmark = pytest.mark.engine

WAIT = 300  # s: generous, the machine is shared


@pytest.fixture(scope="module")
def loaded(checkpoints):
    torch.set_num_threads(1)
    return {k: load_attention_model(d, torch.float32) for k, d in checkpoints.items()}


def _run_all(eng, prompts, params_list):
    """Submit everything before the engine starts, wait for all; returns the requests."""
    return run_requests(eng, prompts, params_list, WAIT)


ARCHS = ["deepseek_v3", "qwen3_moe", "mixtral"]


@pytest.mark.parametrize("arch", ARCHS)
def test_runner_logits_match_transformers(arch, checkpoints, loaded):
    """Chunked prefill, batched prefills, and decode (MLA: absorbed) give transformers' logits."""
    model, _, _ = loaded[arch]
    cache = PagedKVCache(kv_cache_spec(model), 1 << 20, block_size=4)
    runner = PagedModelRunner(model, cache)
    toks = [list(range(5, 28)), list(range(100, 109))]  # 23 and 9 tokens
    ref = [reference_logits(checkpoints[arch], t) for t in toks]  # (T, V) each
    bt = [cache.allocator.allocate(cache.blocks_for(len(t))) for t in toks]
    # step 1: first chunk of seq 0 (10 tokens) + first 8 tokens of seq 1
    got = runner.forward([Chunk(toks[0][:10], 0, bt[0]), Chunk(toks[1][:8], 0, bt[1])])
    torch.testing.assert_close(got[0], ref[0][9], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1][7], atol=1e-4, rtol=1e-4)
    # step 2: second chunk of seq 0 together with a decode token of seq 1
    got = runner.forward([Chunk(toks[0][10:22], 10, bt[0]), Chunk(toks[1][8:9], 8, bt[1])])
    torch.testing.assert_close(got[0], ref[0][21], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1][8], atol=1e-4, rtol=1e-4)
    # step 3: decode of seq 0 alone
    got = runner.forward([Chunk(toks[0][22:23], 22, bt[0])])
    torch.testing.assert_close(got[0], ref[0][22], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate_chunked_and_batched_prefill(arch, checkpoints, loaded):
    model, tok, _ = loaded[arch]
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    max_new = [12, 7, 12, 3, 10]
    refs = [
        reference_generate(checkpoints[arch], [p], n)[0]
        for p, n in zip(prompts, max_new, strict=True)
    ]
    # budget of 8 tokens per step: prompts longer than that are chunked, several short prompts
    # are prefilled in one step, and prefill chunks share forwards with decode tokens
    eng = Engine(model, tok, client_id=f"t-{arch}", max_num_batched_tokens=8, block_size=4)
    reqs = _run_all(eng, prompts, [SamplingParams(max_tokens=n) for n in max_new])
    for req, ref in zip(reqs, refs, strict=True):
        assert req.output_ids == ref
    st = eng.stats
    assert st["max_step_tokens"] <= 8
    assert st["prefill_chunks"] > st["prefills"], st  # some prompt was really chunked
    assert st["max_batch"] >= 3, st  # several sequences per forward
    assert eng.kv_cache_usage()["blocks_used"] == 0  # every block came back


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_prompt_logprobs_equal_transformers_with_chunked_prefill(arch, checkpoints, loaded):
    """``prompt_logprobs`` (echo with logprobs): every prompt token after the first gets the
    logprob transformers' forward gives it, also when the prompt is prefilled in chunks of 4
    beside another request's decode."""
    model, tok, _ = loaded[arch]
    prompts = [tok(TEXTS[4])["input_ids"], tok(TEXTS[0])["input_ids"]]
    eng = Engine(model, tok, client_id=f"plp-{arch}", max_num_batched_tokens=4, block_size=4)
    first: list = []
    done = threading.Event()

    def cb(ev):
        if not isinstance(ev, ErrorEvent) and len(first) == 0:
            first.append(ev)
        if isinstance(ev, ErrorEvent) or ev.finish_reason is not None:
            done.set()

    other = eng.submit(prompts[1], SamplingParams(max_tokens=12, ignore_eos=True), lambda ev: None)
    req = eng.submit(prompts[0], SamplingParams(max_tokens=2, prompt_logprobs=3), cb)
    eng.start()
    try:
        assert done.wait(WAIT)
    finally:
        eng.stop()
    p = prompts[0]
    assert len(p) > 8 and eng.stats["prefill_chunks"] > eng.stats["prefills"]  # really chunked
    want = torch.log_softmax(reference_logits(checkpoints[arch], p)[:-1], -1)  # (L - 1, V)
    rows = first[0].prompt_logprobs
    assert rows is req.prompt_logprobs and len(rows) == len(p) and rows[0] is None
    for i in range(1, len(p)):
        lp, top = rows[i]
        assert lp == pytest.approx(float(want[i - 1, p[i]]), abs=1e-4)
        assert [t for t, _ in top] == want[i - 1].topk(3).indices.tolist()
    assert other.output_ids and not other.prompt_logprobs  # not asked: not computed


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate_with_preemption(arch, checkpoints, loaded):
    """A cache of exactly one longest sequence: running sequences are preempted and recomputed."""
    model, tok, _ = loaded[arch]
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    n = 20
    refs = reference_generate(checkpoints[arch], prompts, n)
    spec = kv_cache_spec(model)
    max_len = 48
    eng = Engine(
        model,
        tok,
        client_id=f"p-{arch}",
        block_size=4,
        max_model_len=max_len,
        kv_cache_memory=spec.bytes_per_token * max_len,
        max_num_batched_tokens=16,
    )
    reqs = _run_all(eng, prompts, [SamplingParams(max_tokens=n) for _ in prompts])
    assert eng.stats["preemptions"] > 0, eng.stats
    for req, ref in zip(reqs, refs, strict=True):
        assert req.output_ids == ref
    assert eng.kv_cache_usage()["blocks_used"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_never_written_cache_slots_do_not_poison_decode(arch, checkpoints, loaded):
    """Cache memory comes from ``torch.empty`` and may hold NaN; a decode batch reads whole
    blocks (and padding blocks) past each sequence's end, and masked positions must add nothing."""
    model, tok, _ = loaded[arch]
    prompts = [tok(t)["input_ids"] for t in TEXTS[:3]]
    refs = reference_generate(checkpoints[arch], prompts, 6)
    eng = Engine(model, tok, client_id=f"nan-{arch}", block_size=4)
    for t in eng.kv_cache.latent + eng.kv_cache.keys + eng.kv_cache.values:
        t.fill_(float("nan"))
    reqs = _run_all(eng, prompts, [SamplingParams(max_tokens=6) for _ in prompts])
    assert [r.output_ids for r in reqs] == refs


def test_seeded_sampling_equals_reference_engine(loaded):
    """The previous engine (transformers' forward) and the paged one draw the same tokens."""
    model, tok, _ = loaded["deepseek_v3"]
    prompts = [tok(t)["input_ids"] for t in TEXTS[:3]]
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True)
        for i in range(3)
    ]
    new = _run_all(Engine(model, tok, client_id="s-new"), prompts, params)
    old = _run_all(ReferenceEngine(model, tok, client_id="s-old"), prompts, params)
    assert [r.output_ids for r in new] == [r.output_ids for r in old]
    assert all(len(r.output_ids) == 10 for r in new)


def test_kv_cache_is_preallocated_and_never_copied(loaded):
    model, tok, _ = loaded["deepseek_v3"]
    eng = Engine(model, tok, client_id="kv", kv_cache_memory=4 << 20)
    spec = eng.kv_cache.spec
    assert spec.kind == "mla"
    # MLA caches the compressed latent only: kv_lora_rank + qk_rope_head_dim per token and layer
    cfg = model.config
    assert spec.key_dim == cfg.kv_lora_rank + cfg.qk_rope_head_dim and spec.value_dim == 0
    usage = eng.kv_cache_usage()
    assert usage["bytes"] <= 4 << 20
    assert usage["blocks_total"] == (4 << 20) // (usage["block_size"] * spec.bytes_per_token)
    ptrs = [t.data_ptr() for t in eng.kv_cache.latent]
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    seen_used: list[int] = []

    def watch(ev):
        seen_used.append(eng.kv_cache_usage()["blocks_used"])

    eng.start()
    try:
        reqs = [eng.submit(p, SamplingParams(max_tokens=8), watch) for p in prompts]
        for r in reqs:
            _wait_done(r)
    finally:
        eng.stop()
    assert max(seen_used) > 0
    assert [t.data_ptr() for t in eng.kv_cache.latent] == ptrs  # same storage throughout
    assert eng.kv_cache_usage()["blocks_used"] == 0


def _wait_done(req, timeout=WAIT):
    ev = threading.Event()

    def poll():
        while not req.done and not ev.wait(0.01):
            pass

    t = threading.Thread(target=poll)
    t.start()
    t.join(timeout)
    ev.set()
    assert req.done, "request did not finish"


def test_kv_cache_memory_below_one_sequence_is_rejected(loaded):
    model, tok, _ = loaded["deepseek_v3"]
    spec = kv_cache_spec(model)
    with pytest.raises(ValueError, match="kv-cache-memory"):
        Engine(model, tok, max_model_len=64, kv_cache_memory=spec.bytes_per_token * 48)
    eng = Engine(model, tok, max_model_len=64, kv_cache_memory=spec.bytes_per_token * 64)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.submit(list(range(64)), SamplingParams(), lambda ev: None)


def test_sequence_stops_at_max_model_len(loaded):
    model, tok, _ = loaded["deepseek_v3"]
    spec = kv_cache_spec(model)
    eng = Engine(
        model, tok, max_model_len=20, block_size=4, kv_cache_memory=spec.bytes_per_token * 20
    )
    eng.start()
    try:
        req = eng.generate(list(range(3, 13)), SamplingParams(max_tokens=50, ignore_eos=True))
    finally:
        eng.stop()
    assert req.finish_reason == "length"
    assert len(req.prompt_ids) + len(req.output_ids) == 20


def test_parse_memory_size():
    assert parse_memory_size("512MiB") == 512 * 2**20
    assert parse_memory_size("2GiB") == 2 * 2**30
    assert parse_memory_size("1.5GB") == 1_500_000_000
    assert parse_memory_size("4096") == 4096
    for bad in ("", "-1GiB", "12 parsecs", "0"):
        with pytest.raises(ValueError, match="memory size"):
            parse_memory_size(bad)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_on_cuda_equals_generate(arch, checkpoints):
    """--device cuda: model and KV cache on the GPU, same greedy tokens as the CPU reference."""
    model, tok, _ = load_attention_model(checkpoints[arch], torch.float32, device="cuda")
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    refs = reference_generate(checkpoints[arch], prompts, 10)
    eng = Engine(model, tok, client_id=f"cuda-{arch}", max_num_batched_tokens=8, block_size=4)
    assert eng.kv_cache_usage()["blocks_total"] > 0
    reqs = _run_all(eng, prompts, [SamplingParams(max_tokens=10) for _ in prompts])
    assert all(t.is_cuda for t in (eng.kv_cache.latent or eng.kv_cache.keys))
    for req, ref in zip(reqs, refs, strict=True):
        assert req.output_ids == ref


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kv-cache-memory", "1KiB"], "is below one sequence of"),
        (["--kv-cache-memory", "lots"], "bad memory size 'lots'"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda"),
        (["--prefill-tokens-while-decoding", "lots"], "--prefill-tokens-while-decoding must be"),
    ],
)
def test_attention_client_rejects_bad_engine_options(args, message):
    """Exit code 2 and one message naming the problem, before serving anything."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "eaas", "attention-client", "--local-experts", "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert message in " ".join(out.split()), out
    assert "Traceback" not in out and "ready on" not in out, out


def test_long_prompt_is_chunked_while_others_decode_and_cancels_mid_prefill(checkpoints, loaded):
    model, tok, _ = loaded["deepseek_v3"]
    words = " ".join(["expert server routing table attention client"] * 240)
    ids = tok(words)["input_ids"]
    long_a, long_b = ids[:200], ids[200:1400]
    assert len(long_b) == 1200
    ref = reference_generate(checkpoints["deepseek_v3"], [long_a], 2)[0]
    eng = Engine(model, tok, client_id="chunks", max_num_batched_tokens=8)
    eng.start()
    try:
        r1 = eng.submit(
            tok("Hello")["input_ids"],
            SamplingParams(max_tokens=2000, ignore_eos=True),
            lambda ev: None,
        )
        assert wait_until(lambda: len(r1.output_ids) >= 2, WAIT, 0.002)
        n_before = len(r1.output_ids)
        at_first: list[int] = []
        r2 = eng.submit(
            long_a,
            SamplingParams(max_tokens=2),
            lambda ev: at_first.append(len(r1.output_ids)) if not at_first else None,
        )
        assert wait_until(lambda: r2.done, WAIT, 0.002)
        assert r2.output_ids == ref
        # r1 decoded in every step of r2's ~200 / 7 prefill chunks (8 tokens per step)
        assert at_first[0] - n_before >= len(long_a) // 8, (at_first, n_before)
        assert eng.stats["max_step_tokens"] <= 8
        # a 1200-token prompt takes ~170 steps to prefill: cancel it as soon as it is admitted
        r3 = eng.submit(long_b, SamplingParams(max_tokens=5), lambda ev: None)
        assert wait_until(lambda: eng.num_running == 2, WAIT, 0.002)
        r3.cancel()
        assert wait_until(lambda: eng.num_running == 1, WAIT, 0.002)
        assert r3.finish_reason == "cancelled" and r3.output_ids == []
        n1 = len(r1.output_ids)
        assert wait_until(lambda: len(r1.output_ids) > n1 + 2, WAIT, 0.002)  # r1 still decoding
        # only r1's blocks are left
        assert eng.kv_cache_usage()["blocks_used"] <= -(-(1 + len(r1.output_ids) + 8) // 16)
    finally:
        r1.cancel()
        eng.stop()


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


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral"])
@pytest.mark.parametrize("cap", [3, "auto"])
def test_greedy_equals_generate_with_prefill_cap_while_decoding(arch, cap, checkpoints, loaded):
    """Capped prefill in decode steps changes the steps, never the tokens."""
    model, tok, _ = loaded[arch]
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    max_new = [12, 7, 12, 3, 10]
    refs = [
        reference_generate(checkpoints[arch], [p], n)[0]
        for p, n in zip(prompts, max_new, strict=True)
    ]
    eng = Engine(
        model,
        tok,
        client_id=f"cap-{arch}-{cap}",
        max_num_batched_tokens=16,
        block_size=4,
        prefill_tokens_while_decoding=cap,
    )
    reqs = _run_all(eng, prompts, [SamplingParams(max_tokens=n) for n in max_new])
    for req, ref in zip(reqs, refs, strict=True):
        assert req.output_ids == ref
    st = eng.stats
    assert st["max_step_tokens"] <= 16
    if cap == 3:
        assert 0 < st["max_prefill_tokens_while_decoding"] <= 3, st
    assert eng.kv_cache_usage()["blocks_used"] == 0


def test_greedy_equals_generate_with_burst_steps(checkpoints, loaded):
    """``auto``: burst steps (decodes held) change the steps, never the tokens."""
    model, tok, _ = loaded["deepseek_v3"]
    prompts = [tok(TEXTS[2])["input_ids"], tok(TEXTS[4])["input_ids"]]
    assert len(prompts[0]) < 8 < len(prompts[1]) - 8
    max_new = 120  # 2 x 119 gaps: 0.005 of them allows one stretched gap
    refs = [reference_generate(checkpoints["deepseek_v3"], [p], max_new)[0] for p in prompts]
    eng = Engine(
        model,
        tok,
        client_id="burst",
        max_num_batched_tokens=8,
        block_size=4,
        prefill_tokens_while_decoding="auto",
    )
    reqs = _run_all(eng, prompts, [SamplingParams(max_tokens=max_new)] * 2)
    for req, ref in zip(reqs, refs, strict=True):
        assert req.output_ids == ref
    # step 2: the short prompt is held, the long one's chunk takes the whole budget (8 tokens,
    # more than the cap of 4 before any step was measured), as long as prompt tokens are left
    assert eng.stats["burst_steps"] >= 1, eng.stats


def test_serve_rejects_a_bad_prefill_cap_before_starting_anything():
    import subprocess
    import sys

    from eaas.runtime.common.ports import free_tcp_port

    r = subprocess.run(
        [sys.executable, "-m", "eaas", "serve", "--port", str(free_tcp_port())]
        + ["--prefill-tokens-while-decoding", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "--prefill-tokens-while-decoding must be auto, off or a token count" in " ".join(
        out.split()
    ), out
    assert "expert-server" not in out and "Traceback" not in out, out
