"""The CPU compute policy of bfloat16 deployments (``--cpu-bf16-compute {auto,native,fp32}``).

* the decision (pure): what each policy picks on CPU / CUDA, for bfloat16 / float32;
* logits: the float32-compute path (bf16-rounded weights upcast, bf16 KV cache) against the
  native bfloat16 path and against the float32 model, on the tiny DeepSeek-V3 (MLA), a
  Qwen3-MoE and a Mixtral (GQA) checkpoint, prefill and decode steps through the paged runner;
* real processes: two ``eaas expert-server`` processes (native / fp32) answer the same bfloat16
  frames within bfloat16 tolerance and say what they compute in on ``/health``; an
  ``eaas attention-client`` says it on ``/health`` and serves; a bad value is exit code 2
  naming the option (attention-client, expert-server, serve).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from eaas.runtime.client.kv_cache import PagedKVCache, kv_cache_spec
from eaas.runtime.client.model_runner import Chunk, PagedModelRunner
from eaas.runtime.experts import ExpertWeights, weighted_expert_sum
from eaas.runtime.models.attention import load_attention_model
from eaas.runtime.models.compute import calibrate_linear, choose_compute, decide_compute
from eaas.runtime.models.tokenizer import load_tokenizer
from eaas.runtime.transport.base import STATUS_OK, RequestFrame
from eaas.runtime.transport.factory import connect

from helpers.cli import run_eaas_all
from helpers.server import free_port, wait_until

pytestmark = pytest.mark.engine

BF16, F32 = torch.bfloat16, torch.float32
WAIT = 300  # s: process start-ups on the shared machine


# ---- the decision ---------------------------------------------------------------------------


def test_decide_compute_policies():
    assert decide_compute(BF16, "cpu", "fp32").compute_dtype == F32
    assert decide_compute(BF16, "cpu", "native").compute_dtype == BF16
    # auto: whichever linear was faster
    slow_bf16 = decide_compute(BF16, "cpu", "auto", native_us=25.0, fp32_us=4.1)
    assert slow_bf16.compute_dtype == F32 and slow_bf16.upcast
    assert slow_bf16.as_dict()["calibration_us"] == {"native": 25.0, "fp32": 4.1}
    fast_bf16 = decide_compute(BF16, "cpu", "auto", native_us=3.0, fp32_us=4.1)
    assert fast_bf16.compute_dtype == BF16 and not fast_bf16.upcast
    # cuda: native bf16 whatever is asked; float32 deployments compute in float32
    for policy in ("auto", "native", "fp32"):
        assert decide_compute(BF16, "cuda", policy).compute_dtype == BF16
        assert decide_compute(F32, "cpu", policy).compute_dtype == F32
    with pytest.raises(ValueError, match="--cpu-bf16-compute must be one of auto, native, fp32"):
        decide_compute(BF16, "cpu", "fast")
    with pytest.raises(ValueError, match="calibration"):
        decide_compute(BF16, "cpu", "auto")


def test_auto_calibrates_on_cpu_only():
    native_us, fp32_us = calibrate_linear(8, 64, 32, reps=5)
    assert native_us > 0 and fp32_us > 0
    auto = choose_compute(BF16, "cpu", "auto", (8, 64, 32))
    assert auto.native_us is not None and auto.fp32_us is not None
    assert auto.compute_dtype == (F32 if auto.fp32_us < auto.native_us else BF16)
    assert choose_compute(F32, "cpu", "auto", (8, 64, 32)).native_us is None  # no calibration


# ---- logits through the paged runner --------------------------------------------------------


def _logits(model, prompt: list[int], feed: list[int]) -> torch.Tensor:
    """Next-token logits after a prefill of ``prompt`` and after each decode token of ``feed``
    (the same inputs for every model): ``(1 + len(feed), V)`` float32."""
    cache = PagedKVCache(kv_cache_spec(model), 1 << 20, block_size=4)
    runner = PagedModelRunner(model, cache)
    blocks = list(range(cache.num_blocks))
    out = [runner.forward([Chunk(prompt, 0, blocks)])[0]]
    for i, t in enumerate(feed):
        out.append(runner.forward([Chunk([t], len(prompt) + i, blocks)])[0])
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_fp32_compute_logits_match_native_bf16(checkpoints, arch):
    torch.set_num_threads(1)
    d = checkpoints[arch]
    prompt = load_tokenizer(d)("The expert server hosts a set of experts and")["input_ids"]
    feed = [5, 17, 33, 2, 9, 41]
    fp32, _, _ = load_attention_model(d, F32)
    native, _, _ = load_attention_model(d, BF16)
    upcast, _, _ = load_attention_model(d, BF16, compute_dtype=F32)
    # the fp32 path computes in float32 with the bf16-rounded weights (exact upcasts) ...
    for (name, p), q in zip(native.named_parameters(), upcast.parameters(), strict=True):
        assert q.dtype == F32 or p.dtype == F32, name
        assert torch.equal(q.float(), p.float()), name
    # ... and keeps the KV cache in bfloat16
    assert kv_cache_spec(upcast).dtype == BF16 and kv_cache_spec(native).dtype == BF16
    ref, nat, up = (_logits(m, prompt, feed) for m in (fp32, native, upcast))
    scale = ref.abs().max().item()
    err_native = (nat - ref).abs().max().item()
    err_upcast = (up - ref).abs().max().item()
    # within bfloat16 tolerance of the native path (bf16 weights, rounding per op: a few % of
    # the logit range; routing near-ties may flip an expert)
    assert (up - nat).abs().max().item() <= 0.25 * scale, (arch, scale)
    # and no less accurate than native bf16 against the float32 model: logits, greedy tokens
    assert err_upcast <= err_native * 1.05, (arch, err_upcast, err_native)
    agree_up = (up.argmax(-1) == ref.argmax(-1)).sum().item()
    agree_native = (nat.argmax(-1) == ref.argmax(-1)).sum().item()
    assert agree_up >= agree_native >= len(feed) // 2, (arch, agree_up, agree_native)


# ---- real processes -------------------------------------------------------------------------


def _health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.loads(r.read())


def _health_or_none(port: int) -> dict | None:
    try:
        return _health(port)
    except OSError:
        return None


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}


@pytest.mark.e2e
def test_expert_servers_fp32_compute_answer_bf16_frames_like_native(tmp_path, model_dir):
    """Two ``eaas expert-server --dtype bfloat16`` processes, ``--cpu-bf16-compute native`` and
    ``fp32``, get the same bfloat16 frame; answers within bfloat16 tolerance of each other and of
    the float32 math on the bf16-rounded weights; ``/health`` and the log say what each runs."""
    from eaas.runtime.models import arch, weights

    model = model_dir
    info = arch.read_model_info(model)
    layer, H = info.moe_layers[0], info.hidden_size
    procs, socks, ports = {}, {}, {}
    for policy in ("native", "fp32"):
        socks[policy], ports[policy] = f"unix:{tmp_path}/{policy}.sock", free_port()
        procs[policy] = subprocess.Popen(
            [sys.executable, "-m", "eaas", "expert-server", "--model", str(model)]
            + ["--server-id", policy, "--experts", f"{layer}:0-7", "--listen", socks[policy]]
            + ["--dtype", "bfloat16", "--cpu-bf16-compute", policy]
            + ["--http-port", str(ports[policy]), "--http-host", "127.0.0.1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
    try:
        for p in procs.values():
            assert p.stdout is not None
            line = p.stdout.readline()
            assert " ready on " in line, (line, p.poll())
        g = torch.Generator().manual_seed(0)
        h = torch.randn(24, H, generator=g).to(BF16)  # (n, H) on the wire in bf16
        ex = torch.randint(0, 8, (24, 4), generator=g, dtype=torch.int32)
        w = torch.rand(24, 4, generator=g)
        out = {}
        for policy, sock in socks.items():
            c = connect(sock, policy, hidden_size=H, dtype=BF16)
            c.send(RequestFrame(1, layer, 1, 0, h, ex, w))
            r = c.recv(time.monotonic() + 60)
            assert r.status == STATUS_OK, r.message
            assert r.output.dtype == BF16  # the wire stays bfloat16
            out[policy] = r.output.float()
            c.close()
        w16 = weights.load_expert_weights(model, [(layer, e) for e in range(8)], BF16, False)
        hosted32 = {
            e: ExpertWeights(w.gate.float(), w.up.float(), w.down.float())
            for (_l, e), w in w16.items()
        }
        ref = weighted_expert_sum(h.float(), ex, w, hosted32)  # fp32 math on bf16 weights
        scale = ref.abs().max().item()
        assert (out["fp32"] - out["native"]).abs().max().item() <= 0.02 * scale
        # fp32 compute rounds once: within one bf16 rounding of the fp32 math
        torch.testing.assert_close(out["fp32"], ref, rtol=2**-8, atol=1e-3 * scale)
        assert (out["fp32"] - ref).abs().max() <= (out["native"] - ref).abs().max()
        for policy, port in ports.items():
            assert wait_until(lambda port=port: _health_or_none(port) is not None, WAIT)
            comp = _health(port)["compute"]
            assert comp["dtype"] == "bfloat16" and comp["cpu_bf16_compute"] == policy
            want = "float32" if policy == "fp32" else "bfloat16"
            assert comp["compute_dtype"] == want
            per = 4 if policy == "fp32" else 2  # float32 copies: twice the bytes
            assert comp["weight_bytes"] == 8 * 3 * info.moe_intermediate_size * H * per
    finally:
        for p in procs.values():
            p.terminate()
        logs = {k: p.communicate(timeout=30)[1] for k, p in procs.items()}
    assert "bfloat16 storage, float32 compute (--cpu-bf16-compute fp32: asked)" in logs["fp32"]
    assert "bfloat16 storage, bfloat16 compute (--cpu-bf16-compute native" in logs["native"]


@pytest.mark.e2e
def test_attention_client_reports_its_compute_and_serves(tmp_path):
    """``eaas attention-client --local-experts --dtype bfloat16``: ``fp32`` computes in float32
    (``/health``'s ``compute``, the log line), ``auto`` reports its calibration; both serve a
    greedy completion."""
    ports = {"fp32": free_port(), "auto": free_port()}
    logs = {k: open(tmp_path / f"{k}.log", "w+") for k in ports}  # noqa: SIM115
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-m", "eaas", "attention-client", "--local-experts"]
            + ["--dtype", "bfloat16", "--cpu-bf16-compute", k, "--port", str(port)],
            stdout=logs[k],
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        for k, port in ports.items()
    }
    try:
        for k, port in ports.items():
            ok = wait_until(
                lambda port=port, k=k: (
                    _health_or_none(port) is not None or procs[k].poll() is not None
                ),
                WAIT,
                0.2,
            )
            assert ok and procs[k].poll() is None, open(tmp_path / f"{k}.log").read()[-3000:]
        fp32 = _health(ports["fp32"])["compute"]
        assert (fp32["dtype"], fp32["compute_dtype"]) == ("bfloat16", "float32")
        assert fp32["cpu_bf16_compute"] == "fp32" and fp32["weight_bytes"] > 0
        auto = _health(ports["auto"])["compute"]
        cal = auto["calibration_us"]
        want = "float32" if cal["fp32"] < cal["native"] else "bfloat16"
        assert auto["compute_dtype"] == want and auto["cpu_bf16_compute"] == "auto"
        # the float32 copies: twice the bytes of the bfloat16 weights
        if want == "float32":
            assert auto["weight_bytes"] == fp32["weight_bytes"]
        for port in ports.values():
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                data=json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=WAIT) as r:
                body = json.loads(r.read())
            assert body["usage"]["completion_tokens"] == 4
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)
    log = open(tmp_path / "fp32.log").read()
    assert "compute: bfloat16 storage, float32 compute (--cpu-bf16-compute fp32: asked)" in log


def test_bad_cpu_bf16_compute_is_a_usage_error():
    runs = run_eaas_all(
        [
            ["attention-client", "--local-experts", "--cpu-bf16-compute", "fast"],
            ["expert-server", "--listen", "unix:/tmp/eaas-never.sock", "--cpu-bf16-compute", "x"],
            ["serve", "--cpu-bf16-compute", "fp16", "--port", str(free_port())],
        ]
    )
    for code, out in runs:
        assert code == 2, out
        assert "--cpu-bf16-compute must be one of auto, native, fp32" in out, out
