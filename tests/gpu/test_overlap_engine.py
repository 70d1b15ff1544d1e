"""Double-batch overlap in the engine (``Engine(double_batch_overlap=True)``): greedy tokens equal
overlap off, with the routed experts on real ``eaas expert-server`` processes (unix sockets), and
the scheduler thread really computes one micro-batch's attention while the other's MoE round trip
is in flight. A GQA model (Qwen3-MoE, local experts) covers the other attention path.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from eaas.runtime.client.dispatch import Dispatcher
from eaas.runtime.client.engine import Engine, ErrorEvent, SamplingParams
from eaas.runtime.client.moe import experts_factory
from eaas.runtime.client.overlap import PagedOverlapRunner
from eaas.runtime.models.arch import read_model_info
from eaas.runtime.models.attention import load_attention_model
from eaas.runtime.placement import place_experts
from eaas.runtime.tables.expert_spec import format_expert_spec
from eaas.runtime.tables.table import RoutingTable

from helpers.checkpoints import small_qwen3
from helpers.engine import generate_greedy

TEXTS = [
    "Hello world",
    "The expert server hosts a set of experts and",
    "Kubernetes",
    "def main(): print",
    "A routing table maps every logical expert to its live replicas",
]
WAIT = 300  # s: generous, the machine is shared


def _generate(eng: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return generate_greedy(eng, prompts, max_tokens, WAIT)


@pytest.fixture(scope="module")
def remote_model(model_dir):
    """The tiny DeepSeek-V3 with its routed experts on two expert-server processes."""
    info = read_model_info(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="eaas-dbo-"))
    placement = place_experts(info.moe_layers, info.num_experts, 2, 1)
    ids = ["s0", "s1"]
    endpoints = [f"unix:{tmp}/s{i}.sock" for i in range(2)]
    procs = []
    for i, sid in enumerate(ids):
        cmd = [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
        cmd += ["--server-id", sid, "--listen", endpoints[i], "--threads", "1"]
        cmd += ["--experts", format_expert_spec(placement.servers[i])]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    dispatcher = None
    try:
        for p in procs:
            line = p.stdout.readline()
            assert " ready on " in line, f"{line!r} (exit {p.poll()})"
        table = RoutingTable.from_placement(placement, ids, endpoints, version=1)
        dispatcher = Dispatcher(0, info.hidden_size, torch.float32, timeout=60.0)
        dispatcher.set_table(table)
        model, tok, _ = load_attention_model(
            model_dir, torch.float32, experts_factory=experts_factory(dispatcher)
        )
        yield model, tok
    finally:
        if dispatcher is not None:
            dispatcher.close()
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_overlap_greedy_equals_overlap_off_with_expert_servers(remote_model):
    model, tok = remote_model
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    off = Engine(model, tok, client_id="dbo-off")
    want = _generate(off, prompts, 10)
    on = Engine(model, tok, client_id="dbo-on", double_batch_overlap=True)
    assert isinstance(on.runner, PagedOverlapRunner)
    got = _generate(on, prompts, 10)
    assert got == want
    st = on.runner.stats
    # 5 sequences decode together for most of their 9 decode steps: those run as two
    # micro-batches; the prefill step runs plain
    assert st["overlap_steps"] >= 5, st
    assert st["plain_steps"] >= 1, st
    # the overlap happened: attentions were computed while a MoE round trip was in flight
    assert st["attn_during_moe"] >= st["overlap_steps"], st
    assert on.stats["decode_steps"] == off.stats["decode_steps"]


def test_overlap_error_in_a_round_trip_fails_the_step_and_engine_keeps_serving(remote_model):
    """A MoE call that raises on the worker thread fails exactly that step's requests (no hang,
    no MoE call left running), and the same engine then serves the next requests."""
    model, tok = remote_model
    prompts = [tok(t)["input_ids"] for t in TEXTS[:3]]
    want = _generate(Engine(model, tok, client_id="dbo-ref"), prompts, 3)
    eng = Engine(model, tok, client_id="dbo-err", double_batch_overlap=True)
    runner = eng.runner
    assert isinstance(runner, PagedOverlapRunner)
    mlp = runner.model.model.layers[-1].mlp
    real = mlp.forward
    armed = {"on": True}

    def flaky(h, *a, **kw):
        # the prefill step has more rows than sequences; a micro-batch has fewer
        if armed["on"] and h.shape[1] < len(prompts):
            armed["on"] = False
            raise RuntimeError("injected MoE failure")
        return real(h, *a, **kw)

    mlp.forward = flaky
    try:
        done = [threading.Event() for _ in prompts]
        errors: list[BaseException] = []

        def cb(i):
            def f(ev):
                if isinstance(ev, ErrorEvent):
                    errors.append(ev.error)
                if isinstance(ev, ErrorEvent) or ev.finish_reason is not None:
                    done[i].set()

            return f

        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.submit(p, params, cb(i))
        eng.start()
        for d in done:
            assert d.wait(WAIT)
        assert not armed["on"], "the failure was not injected"
        assert len(errors) == len(prompts), errors
        assert all("injected MoE failure" in str(e) for e in errors), errors
        # the engine keeps serving, overlapped, with the same tokens as overlap off
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        done_before = runner.stats["overlap_steps"]
        reqs = [eng.submit(p, params, lambda ev: None) for p in prompts]
        for r in reqs:
            _wait_done(r)
        assert [r.output_ids for r in reqs] == want
        assert runner.stats["overlap_steps"] > done_before
    finally:
        mlp.forward = real
        eng.stop()


def _wait_done(req, timeout: float = WAIT) -> None:
    ev = threading.Event()
    # poll the request's state (set on the scheduler thread) with a generous deadline
    import time

    end = time.monotonic() + timeout
    while not req.done and time.monotonic() < end:
        ev.wait(0.05)
    assert req.done and req.finish_reason == "length", req.finish_reason


def test_overlap_gqa_local_experts(tmp_path, model_dir):
    small_qwen3(tmp_path, Path(model_dir))
    model, tok, _ = load_attention_model(str(tmp_path), torch.float32)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    want = _generate(Engine(model, tok, client_id="gqa-off"), prompts, 8)
    on = Engine(model, tok, client_id="gqa-on", double_batch_overlap=True)
    assert _generate(on, prompts, 8) == want
    assert on.runner.stats["overlap_steps"] >= 5
