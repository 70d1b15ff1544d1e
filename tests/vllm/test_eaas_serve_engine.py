"""``eaas serve --engine vllm``: serve's expert servers and routing table, with one
``vllm serve`` + the eaas.vllm plugin in the attention clients' place.

The tiny Qwen3-MoE (fp32), 4 expert servers with 2 replicas: a greedy completion equals our
own engine's tokens, the plugin's port reports serve's table, and SIGTERM stops everything.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from eaas.runtime.client.engine import Engine
from eaas.runtime.models.attention import load_attention_model

from helpers.common import free_port
from helpers.engine import generate_greedy
from helpers.vllm import VLLM_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # vLLM's start: minutes when busy

PROMPT = [5, 17, 42, 99, 3, 250, 7]
MAX_TOKENS = 16


def test_serve_engine_vllm(vllm_python, vllm_models, tmp_path):
    model_dir = vllm_models["qwen3_moe"]  # vLLM's CPU DeepSeek-V3 differs (test_exactness.py)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EAAS_", "PROMETHEUS_"))}
    env.update(VLLM_ENV)
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "eaas", "serve", "--engine", "vllm"]
    cmd += ["--vllm", str(vllm_python / "bin" / "vllm"), "--port", str(port)]
    cmd += ["--model", model_dir]
    cmd += ["--expert-servers", "4", "--replicas", "2", "--max-num-batched-tokens", "256"]
    cmd += ["--vllm-args", "--enforce-eager --max-model-len 256 --max-num-seqs 8"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd="/", env=env)
    try:
        deadline = time.monotonic() + 600
        while not re.search(
            r"\[eaas serve\] serving \S+ on http://", log.read_text(errors="replace")
        ):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        text = log.read_text()
        plugin = re.search(r"plugin port (http://\S+)", text)
        assert plugin, text[-3000:]
        # serve ran its servers with the vllm command's Python: vLLM's CPU MoE kernel there
        assert len(re.findall(r"expert-server expert-\d cpu kernel vllm", text)) == 4, text[-3000:]
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={
                "model": name,
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=300,
        )
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["token_ids"]
        h = httpx.get(f"{plugin.group(1)}/health", timeout=10).json()
        assert h["status"] == "ok" and h["routing_table_version"] == 1
        assert sorted(h["servers"]) == [f"expert-{i}" for i in range(4)]
        assert h["moe_layers"] == [1, 2]
        torch.set_num_threads(1)
        model, tok, _ = load_attention_model(model_dir, torch.float32)
        (want,) = generate_greedy(Engine(model, tok, client_id="ref"), [PROMPT], MAX_TOKENS, 300)
        assert got == want
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    assert rc == 0, log.read_text()[-3000:]
