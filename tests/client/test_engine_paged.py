"""Paged engine: exactness against transformers for all three architectures, with chunked and
batched prefill and with preemption forced; the KV cache manager. The scheduler's policy as pure
logic: test_scheduler_policy.py.

Ground truth: transformers' ``generate`` (greedy, fp32, one prompt at a time) and its forward's
logits; the previous engine (:class:`ReferenceEngine`, transformers' forward over a merged cache)
for seeded sampling. Local experts only (the disaggregated path is covered in tests/e2e).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from eaas.runtime.client.engine import Engine, ErrorEvent, SamplingParams
from eaas.runtime.client.kv_cache import (
    PagedKVCache,
    kv_cache_spec,
    parse_memory_size,
)
from eaas.runtime.client.model_runner import Chunk, PagedModelRunner
from eaas.runtime.client.reference_engine import ReferenceEngine
from eaas.runtime.models.attention import load_attention_model
from eaas.runtime.models.reference import reference_generate, reference_logits

from helpers.common import free_port, wait_until
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
    r = subprocess.run(
        [sys.executable, "-m", "eaas", "serve", "--port", str(free_port())]
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
