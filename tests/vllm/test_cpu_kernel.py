"""An expert server's ``--cpu-kernel vllm`` (vLLM's CPU fused-MoE kernel,
:mod:`eaas.runtime.server.cpu_fused`) computes what its torch path computes.

Run in the vLLM venv's Python (the kernel library is vLLM's CPU build's): for float32 and
bfloat16, tiny and real-ish shapes, batches with and without padding ids (a frame's ids of
experts a server does not host are ``-1``) and one token per expert up to a prefill-sized
batch, the fused layer's output equals ``grouped_expert_sum``'s within the dtype's rounding and
the expert loads are equal; an ``ExpertServer`` there resolves ``auto`` to ``vllm`` and picks
the fused layer for a decode-sized batch only. In this test's own Python (no vLLM),
``--cpu-kernel vllm`` exits 2 with the reason and ``auto`` is torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from eaas.runtime.server.server import resolve_cpu_kernel

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

SCRIPT = r"""
import json, torch
from eaas.runtime.experts import ExpertWeights
from eaas.runtime.server.compute import grouped_expert_sum
from eaas.runtime.server.hosting import Hosting, LayerStack
from eaas.runtime.server.cpu_fused import FusedLayer, load_kernel
from eaas.runtime.server.server import FUSED_MAX_PAIRS, ExpertServer

torch.set_num_threads(1)
rows = []
g = torch.Generator().manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    for H, I, E, k in ((256, 128, 32, 4), (512, 256, 16, 8)):
        hosted = {
            e: ExpertWeights(*(torch.randn(*s, generator=g).mul(0.1).to(dt)
                               for s in ((I, H), (I, H), (H, I))))
            for e in range(1, E, 2)  # the odd experts: a server's half
        }
        stack = LayerStack.build(hosted)
        fused = FusedLayer.build(stack)
        for n, pad in ((1, False), (5, True), (16, True), (16, False), (300, True)):
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
            if pad:
                ids[ids % 2 == 0] = -1  # not hosted here: padding, as the dispatcher sends
            else:
                ids = ids | 1  # every id hosted (may repeat an expert within a token)
            ids = ids.to(torch.int32)
            w = torch.softmax(torch.randn(n, k, generator=g), 1)
            x = torch.randn(n, H, generator=g).to(dt)
            ref, ref_loads = grouped_expert_sum(x, ids, w, stack.experts, stack)
            out, loads = fused(x, ids, w)
            rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            rows.append({"dtype": str(dt), "shape": [H, I, E, k], "n": n, "pad": pad,
                         "rel": rel, "loads_equal": loads == ref_loads,
                         "out_dtype": str(out.dtype), "out_shape": list(out.shape)})
        del fused
# the server: auto -> vllm here; the fused layer for a decode batch, none above the limit
pairs = {(1, e): w for e, w in hosted.items()}
srv = ExpertServer("unix:/tmp/eaas-cpu-kernel-test-%d.sock" % __import__("os").getpid(),
                   pairs, H, torch.bfloat16, "t")
hosting = srv._hosting
small = torch.full((4, k), 1, dtype=torch.int32)
big = torch.full((FUSED_MAX_PAIRS[torch.bfloat16] // k + 1, k), 1, dtype=torch.int32)
print(json.dumps({"load": load_kernel(), "kernel": srv.cpu_kernel,
                  "info": srv.compute_info()["cpu_kernel"],
                  "small": srv._fused_layer(1, hosting, small) is not None,
                  "big": srv._fused_layer(1, hosting, big) is not None,
                  "rows": rows}))
srv.listener.close()
"""

TOLERANCE = {"torch.float32": 1e-5, "torch.bfloat16": 3e-2}  # max |fused - torch| / max |torch|


def test_fused_kernel_equals_the_torch_path(vllm_python):
    r = subprocess.run(
        [str(vllm_python / "bin" / "python"), "-c", SCRIPT],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=500,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["load"] == [True, "loaded"]
    assert res["kernel"] == res["info"] == "vllm"
    assert res["small"] is True and res["big"] is False
    assert len(res["rows"]) == 20
    for row in res["rows"]:
        assert row["loads_equal"], row
        assert row["rel"] <= TOLERANCE[row["dtype"]], row
        assert row["out_dtype"] == row["dtype"] and row["out_shape"][0] == row["n"], row


def test_without_vllm_auto_is_torch_and_vllm_is_refused(tmp_path):
    # this test's Python has no vLLM: --cpu-kernel vllm is a usage error naming the reason
    r = subprocess.run(
        [sys.executable, "-m", "eaas", "expert-server", "--listen", f"unix:{tmp_path}/s.sock"]
        + ["--cpu-kernel", "vllm"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--cpu-kernel vllm" in r.stderr and "no vllm in this Python" in r.stderr
    assert resolve_cpu_kernel("auto", torch.device("cpu")) == (
        "torch",
        "auto: no vllm in this Python",
    )
    with pytest.raises(ValueError, match="--cpu-kernel must be one of auto, torch, vllm"):
        resolve_cpu_kernel("fast", torch.device("cpu"))
