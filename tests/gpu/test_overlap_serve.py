"""``eaas serve --double-batch-overlap`` end to end with the official ``openai`` client: greedy
tokens equal transformers' ``generate``, and the attention client's ``/health`` shows decode
steps run as overlapped micro-batches (the flag reaches the engine and acts)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_helpers import start_serve  # noqa: E402

from eaas.runtime.models.reference import reference_generate  # noqa: E402
from eaas.runtime.models.tiny import default_model_dir  # noqa: E402

pytestmark = pytest.mark.gpu_cpu

TEXTS = [
    "Hello world",
    "The expert server hosts a set of experts and",
    "Kubernetes schedules pods on nodes",
    "def main(): print",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    sp = start_serve(
        tmp_path_factory,
        "serve-dbo",
        ["--expert-servers", "2", "--replicas", "1", "--double-batch-overlap"],
    )
    yield sp
    sp.stop(check=True)


def test_serve_double_batch_overlap_greedy_equals_reference(deployment):
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    model_dir = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    refs = reference_generate(model_dir, prompts, MAX_TOKENS)
    base = deployment.base_url
    name = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]

    def complete(p):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return c.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        finally:
            c.close()

    # repeat until some requests decode together (concurrent, but the scheduler decides)
    for _ in range(3):
        with ThreadPoolExecutor(len(prompts)) as ex:
            results = list(ex.map(complete, prompts))
        for r, ref in zip(results, refs, strict=True):
            assert r.choices[0].model_extra["token_ids"] == ref
        h = httpx.get(f"{base}/health", timeout=10).json()
        if h["double_batch_overlap"]["overlap_steps"] > 0:
            break
    dbo = h["double_batch_overlap"]
    assert dbo["overlap_steps"] > 0, dbo
    assert dbo["attn_during_moe"] > 0, dbo
