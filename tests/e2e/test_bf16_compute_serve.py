"""``eaas serve --dtype bfloat16 --cpu-bf16-compute fp32`` passes the policy to every child: the
expert servers and the attention client compute in float32 (their log lines, the client's
``/health``), frames stay bfloat16, and greedy completions come back."""

from __future__ import annotations

import httpx
import pytest

from helpers.e2e import ServeProcess, free_port

pytestmark = pytest.mark.engine


def test_serve_passes_cpu_bf16_compute_to_every_child(tmp_path):
    sp = ServeProcess(
        ["--dtype", "bfloat16", "--cpu-bf16-compute", "fp32", "--expert-servers", "2"]
        + ["--replicas", "1"],
        tmp_path / "serve.log",
        free_port(),
    )
    sp.start()
    try:
        h = httpx.get(f"{sp.base_url}/health", timeout=30).json()
        assert h["compute"]["dtype"] == "bfloat16"
        assert h["compute"]["compute_dtype"] == "float32"
        assert h["compute"]["cpu_bf16_compute"] == "fp32"
        r = httpx.post(
            f"{sp.base_url}/v1/completions",
            json={
                "prompt": "Hello world",
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == 8
        line = "compute: bfloat16 storage, float32 compute (--cpu-bf16-compute fp32: asked)"
        log = sp.log()
        for sid in ("expert-0", "expert-1"):
            assert f"expert-server {sid} {line}" in log, log[-3000:]
    finally:
        sp.stop(check=True)
