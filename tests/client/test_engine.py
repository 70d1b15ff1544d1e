"""Engine (continuous batching) on the tiny model with local experts, against transformers' generate.

No expert servers here: this isolates the scheduler, the paged KV cache, sampling, stops and
cancellation. The disaggregated path is covered in tests/e2e.
"""

from __future__ import annotations

import threading

import pytest
import torch

from eaas.runtime.client.engine import Engine, ErrorEvent, SamplingParams, TokenEvent
from eaas.runtime.models.attention import load_attention_model
from eaas.runtime.models.reference import reference_generate

from helpers.common import wait_until
from helpers.engine import ENGINE_TEXTS as TEXTS

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def loaded(model_dir):
    torch.set_num_threads(1)
    model, tok, info = load_attention_model(model_dir, torch.float32)
    return model, tok, info


@pytest.fixture()
def engine(loaded):
    model, tok, _ = loaded
    eng = Engine(model, tok, client_id="test")
    yield eng
    eng.stop()


def _prompts(tok):
    return [tok(t)["input_ids"] for t in TEXTS]


def _collect(eng: Engine, prompt, params):
    done = threading.Event()
    events = []

    def cb(ev):
        events.append(ev)
        if isinstance(ev, ErrorEvent) or ev.finish_reason is not None:
            done.set()

    req = eng.submit(prompt, params, cb)
    return req, events, done


def test_batched_greedy_equals_reference(engine, loaded, model_dir):
    _, tok, _ = loaded
    prompts = _prompts(tok)
    # Different lengths of output so sequences leave the batch at different steps (row removal).
    max_new = [12, 7, 12, 3, 10]
    refs = [
        reference_generate(model_dir, [p], n)[0] for p, n in zip(prompts, max_new, strict=False)
    ]
    # Submit everything before the scheduler starts: all requests share decode steps.
    handles = [
        _collect(engine, p, SamplingParams(max_tokens=n, temperature=0.0))
        for p, n in zip(prompts, max_new, strict=False)
    ]
    engine.start()
    for _req, _, done in handles:
        assert done.wait(120)
    assert engine.stats["max_batch"] >= 3, engine.stats  # really batched
    for (req, events, _), ref, n in zip(handles, refs, max_new, strict=False):
        assert req.output_ids == ref
        assert [e.token_id for e in events] == ref
        assert req.finish_reason == ("length" if len(ref) == n else "stop")
        assert req.text == tok.decode(ref, skip_special_tokens=True)
        assert "".join(e.text for e in events) == req.text


def test_late_arrival_joins_running_batch(engine, loaded, model_dir):
    """A request submitted while another decodes joins its forwards (it does not wait for it to
    finish) and both stay exact."""
    _, tok, _ = loaded
    prompts = _prompts(tok)
    refs = reference_generate(model_dir, [prompts[4], prompts[2]], 16)
    engine.start()
    r1, _, d1 = _collect(engine, prompts[4], SamplingParams(max_tokens=48, ignore_eos=True))
    assert wait_until(lambda: len(r1.output_ids) >= 5, 120.0, 0.005)
    n1_at_submit = len(r1.output_ids)
    r2, ev2, d2 = _collect(engine, prompts[2], SamplingParams(max_tokens=16, temperature=0.0))
    assert d2.wait(120)
    # r1 was still decoding when r2 finished: r2 did not wait for r1 to complete
    assert not r1.done
    n1_at_r2_done = len(r1.output_ids)
    assert n1_at_r2_done < 48
    # and r1 kept producing tokens while r2 ran (they shared forwards)
    assert n1_at_r2_done - n1_at_submit >= len(r2.output_ids) - 1
    assert d1.wait(120)
    assert r1.output_ids[: len(refs[0])] == refs[0]
    assert r2.output_ids == refs[1]
    assert engine.stats["max_batch"] >= 2


def test_stop_string_cuts_text(engine, loaded):
    _, tok, _ = loaded
    engine.start()
    prompt = _prompts(tok)[1]
    full = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    first = text.find(stop)
    cut = engine.generate(
        prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=[stop], ignore_eos=True)
    )
    assert cut.finish_reason == "stop"
    assert cut.text == text[:first]
    assert len(cut.output_ids) < 16


def test_seeded_sampling_is_reproducible(engine, loaded):
    _, tok, _ = loaded
    engine.start()
    prompt = _prompts(tok)[0]
    p = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=1234, ignore_eos=True)
    a = engine.generate(prompt, p).output_ids
    b = engine.generate(prompt, p).output_ids
    greedy = engine.generate(
        prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ).output_ids
    assert a == b and len(a) == 12
    assert a != greedy  # temperature 1.5 over 12 tokens: sampling really happened


def test_cancel_leaves_batch_quickly(engine, loaded):
    _, tok, _ = loaded
    engine.start()
    prompts = _prompts(tok)
    long = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
    r1, ev1, _ = _collect(engine, prompts[0], long)
    r2, ev2, _ = _collect(engine, prompts[1], long)
    assert wait_until(lambda: len(ev1) >= 3 and len(ev2) >= 3, 120.0, 0.005)
    assert engine.num_running == 2
    r1.cancel()
    assert wait_until(lambda: engine.num_running == 1, 120.0, 0.005)
    n1 = len(r1.output_ids)
    assert r1.finish_reason == "cancelled"
    n2 = len(r2.output_ids)
    assert wait_until(
        lambda: len(r2.output_ids) >= n2 + 3, 120.0, 0.005
    )  # the other sequence keeps decoding
    assert len(r1.output_ids) == n1  # ... and the cancelled one got nothing more meanwhile
    r2.cancel()
    assert wait_until(lambda: engine.num_running == 0, 120.0, 0.005)
    assert all(isinstance(e, TokenEvent) and e.finish_reason is None for e in ev1)
    assert engine.kv_cache_usage()["blocks_used"] == 0


def test_submit_rejects_bad_input(engine):
    with pytest.raises(ValueError):
        engine.submit([], SamplingParams(), lambda ev: None)
    with pytest.raises(ValueError):
        engine.submit([1, 2], SamplingParams(max_tokens=0), lambda ev: None)


def test_failed_forwards_are_logged_at_most_once_per_interval(engine, loaded, caplog):
    """With every replica of an expert down each engine step fails; the log gets one line per
    FAIL_LOG_INTERVAL_S with the count of the failures in between, not one line per step (116
    lines in ~2 s were seen), and every request still gets its error event."""
    import logging

    from eaas.runtime.client import engine as engine_mod

    _, tok, _ = loaded

    def broken(chunks):
        raise RuntimeError("no live replica (injected)")

    engine.runner.forward_full = broken
    caplog.set_level(logging.WARNING, logger="eaas.client.engine")
    engine.start()
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def fail_one() -> None:
        req, events, done = _collect(engine, tok("Hello world")["input_ids"], params)
        assert done.wait(120)
        assert isinstance(events[-1], ErrorEvent) and req.finish_reason == "error"

    for _ in range(12):
        fail_one()
    lines = [r.getMessage() for r in caplog.records if "forward failed" in r.getMessage()]
    assert len(lines) == 1 and "more failed forwards" not in lines[0], lines
    assert engine.stats["failed"] == 12
    engine._fail_log_at = 0.0  # the interval is over
    fail_one()
    lines = [r.getMessage() for r in caplog.records if "forward failed" in r.getMessage()]
    assert len(lines) == 2, lines
    assert f"(11 more failed forwards in the last {engine_mod.FAIL_LOG_INTERVAL_S:g} s" in lines[1]
