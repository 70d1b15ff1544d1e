"""bench/peer.py's own parts: the W1 workload, the process-tree PSS reading (real processes) and
the target check of the report (pure logic on made-up summaries)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

import loadgen
import peer

pytestmark = pytest.mark.engine


def test_w1_is_token_ids_of_the_asked_shape_and_seeded():
    a = peer.workload_w1(5, 220, 128, vocab=922, seed=3)
    assert len(a) == 5
    for spec in a:
        assert len(spec.prompt) == 220 and spec.max_tokens == 128
        assert all(3 <= t < 922 for t in spec.prompt)
    assert [s.prompt for s in a] == [s.prompt for s in peer.workload_w1(5, 220, 128, 922, 3)]
    assert a[0].prompt != peer.workload_w1(1, 220, 128, 922, 4)[0].prompt


def test_pss_covers_the_whole_process_tree():
    # a parent shell with a sleeping child: both are in the tree, each with a positive PSS
    p = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        # wait until the child has exec'ed sleep (forked but not yet exec'ed it is named "sh":
        # seen once on a loaded machine)
        end = time.monotonic() + 60
        snap = peer.pss_snapshot(p.pid)
        while not any(n.startswith("sleep") for n, _ in snap.values()) and time.monotonic() < end:
            time.sleep(0.05)
            snap = peer.pss_snapshot(p.pid)
        assert p.pid in snap and len(snap) >= 2, snap
        assert all(kib > 0 for _name, kib in snap.values())
        assert any(name.startswith("sleep") for name, _ in snap.values())
        assert peer.pss_kib(os.getpid()) > 10_000  # this test process (a Python interpreter)
    finally:
        os.killpg(p.pid, 9)
        p.wait()
    assert peer.pss_kib(p.pid) is None  # gone


def _summary(tok_s: float, ttft: float, itl50: float, itl99: float) -> dict:
    return {
        "output_tokens_per_s": tok_s,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft,
        "itl_p50_ms": itl50,
        "itl_p99_ms": itl99,
        "tpot_p50_ms": itl50,
        "tpot_p99_ms": itl99,
        "failed": 0,
    }


def test_report_names_each_missed_target():
    args = argparse.Namespace(vllm=True, peer_url=None, workloads="W1")
    res = {
        "float32": {
            "eaas": {"workloads": {"W1": _summary(40.0, 500.0, 10.0, 50.0)}},
            "single": {"workloads": {"W1": _summary(100.0, 200.0, 5.0, 10.0)}},
            "vllm": {"workloads": {"W1": _summary(100.0, 200.0, 5.0, 10.0)}},
        }
    }
    res["float32"]["eaas"]["workloads"]["W1"].update(text_itl_p50_ms=10.0, text_itl_p99_ms=35.0)
    table, misses = peer.report(res, args)
    assert "| W1 | eaas | 40.0 |" in table and "0.40x" in table
    # the text-only ITL ratio is reported beside the token-chunk one (not a target)
    assert "text ITL p99/p50" in table and "| 5.00 | 3.50 |" in table
    assert sorted(m.split(": ")[1].split()[0] for m in misses) == [
        "ITL",
        "TTFT",
        "eaas/single",
        "tok/s",
    ]
    # all met: no misses; a failed system is a miss
    res["float32"]["eaas"]["workloads"]["W1"] = _summary(90.0, 300.0, 10.0, 20.0)
    assert peer.report(res, args)[1] == []
    res["float32"]["eaas"] = {"error": "RuntimeError: boom"}
    assert peer.report(res, args)[1] == ["float32 W1: eaas failed"]


def test_dtype_with_policy_passes_cpu_bf16_compute_to_eaas_only():
    args = argparse.Namespace(
        expert_servers=4,
        replicas=2,
        max_num_batched_tokens=2048,
        prefill_tokens_while_decoding="auto",
        single_threads=1,
        client_spin_us="default",
    )
    for kind in ("eaas", "single"):
        cmd = peer.eaas_command(kind, args, "bfloat16:fp32", 8000, None)
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert cmd[cmd.index("--cpu-bf16-compute") + 1] == "fp32"
        plain = peer.eaas_command(kind, args, "bfloat16", 8000, None)
        assert "--cpu-bf16-compute" not in plain  # the processes' own default (auto)


def _result(tokens: int, ttft: float = 0.1) -> loadgen.RequestResult:
    r = loadgen.RequestResult(ok=True, ttft=ttft, latency=ttft + 0.01 * (tokens - 1))
    r.output_tokens = tokens
    return r


def test_rounds_are_pooled_and_each_round_kept():
    # two rounds: 30 tokens in 1 s, then 10 tokens in 1 s: pooled 20 tok/s, per round 30 and 10
    runs = [([_result(10), _result(20)], 1.0), ([_result(10, ttft=0.3)], 1.0)]
    out = peer.summarize_runs("eaas W2", runs, 16)
    assert out["requests"] == 3 and out["output_tokens"] == 40
    assert out["output_tokens_per_s"] == pytest.approx(20.0)
    assert out["rounds_tok_s"] == pytest.approx([30.0, 10.0])
    assert out["tpot_p50_ms"] == pytest.approx(10.0)
    # the report gives eaas/single pooled and per round
    single = peer.summarize_runs("single W2", [([_result(30)], 1.0), ([_result(40)], 1.0)], 16)
    args = argparse.Namespace(vllm=False, peer_url=None, workloads="W2")
    table, misses = peer.report(
        {"float32": {"eaas": {"workloads": {"W2": out}}, "single": {"workloads": {"W2": single}}}},
        args,
    )
    assert "| W2 | eaas / single | 0.57x (rounds: 1.00, 0.25) |" in table
    assert misses == ["float32 W2: eaas/single 0.57 < 0.85"]


def test_later_rounds_draw_fresh_prompts_of_the_same_shapes():
    args = argparse.Namespace(
        seed=0,
        w1_requests=3,
        w1_prompt_tokens=20,
        w1_output_tokens=8,
        w2_requests=5,
        w2_length_scale=0.2,
        max_model_len=2048,
    )
    base = {
        "W1": (peer.workload_w1(3, 20, 8, 922, 0), 3),
        "W2": (loadgen.make_workload(5, 0, 0.2, 2048), 16),
    }
    assert peer.round_workloads(base, 0, args, 922) is base
    r1 = peer.round_workloads(base, 1, args, 922)
    for w in ("W1", "W2"):
        assert r1[w][1] == base[w][1] and len(r1[w][0]) == len(base[w][0])
        assert [s.prompt for s in r1[w][0]] != [s.prompt for s in base[w][0]]
    assert all(len(s.prompt) == 20 and s.max_tokens == 8 for s in r1["W1"][0])
    # W2: every request keeps its prompt and output lengths, only the words are new
    for a, b in zip(r1["W2"][0], base["W2"][0], strict=True):
        assert (a.prompt_words, a.max_tokens) == (b.prompt_words, b.max_tokens)
        assert len(a.prompt.split()) == a.prompt_words
    # every round is the same for every system: a round's requests depend on the round alone
    again = peer.round_workloads(base, 1, args, 922)
    assert [s.prompt for s in again["W2"][0]] == [s.prompt for s in r1["W2"][0]]


def test_wait_quiet_waits_for_a_busy_idle_system():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    calm = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        waited, quiet = peer.wait_quiet([busy.pid], window=0.5, timeout=2.0)
        assert not quiet and waited >= 2.0
        waited, quiet = peer.wait_quiet([calm.pid], window=0.5, timeout=30.0)
        assert quiet
    finally:
        for p in (busy, calm):
            os.killpg(p.pid, 9)
            p.wait()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--short", "--rounds", "0"], "--rounds must be >= 1"),
        (["--settle-window", "0"], "--settle-window must be > 0"),
        (["--settle-timeout", "-1"], "--settle-timeout >= 0"),
        (["--systems", "eaas,foo"], "unknown system 'foo'"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(argv, message):
    with pytest.raises(SystemExit) as e:
        peer.main(argv)
    assert message in str(e.value)


def test_report_gives_vllm_eaas_against_vllm_and_eaas():
    args = argparse.Namespace(vllm=True, peer_url=None, workloads="W1")
    res = {
        "float32": {
            "eaas": {"workloads": {"W1": _summary(40.0, 500.0, 10.0, 20.0)}},
            "vllm": {"workloads": {"W1": _summary(100.0, 200.0, 5.0, 10.0)}},
            "vllm+eaas": {"workloads": {"W1": _summary(80.0, 250.0, 6.0, 12.0)}},
        }
    }
    table, misses = peer.report(res, args)
    assert "| W1 | vllm+eaas / vllm | 0.80x |" in table
    assert "| W1 | vllm+eaas / eaas | 2.00x |" in table
    assert "float32 W1: vllm+eaas/vllm 0.80 < 0.9" in misses
    assert not any("vllm+eaas/eaas" in m for m in misses)
