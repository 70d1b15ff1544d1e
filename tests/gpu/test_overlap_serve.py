"""``eaas serve --double-batch-overlap`` end to end with the official ``openai`` client: greedy
tokens equal transformers' ``generate``, and the attention client's ``/health`` shows decode
steps run as overlapped micro-batches (the flag reaches the engine and acts)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import torch

from eaas.runtime.models.reference import reference_generate

from helpers.e2e import serve_fixture, served_model_name

TEXTS = [
    "Hello world",
    "The expert server hosts a set of experts and",
    "Kubernetes schedules pods on nodes",
    "def main(): print",
]
MAX_TOKENS = 12


deployment = serve_fixture(
    "serve-dbo", ["--expert-servers", "2", "--replicas", "1", "--double-batch-overlap"]
)


def test_serve_double_batch_overlap_greedy_equals_reference(deployment, model_dir, tokenizer):
    torch.set_num_threads(1)
    tok = tokenizer
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    refs = reference_generate(model_dir, prompts, MAX_TOKENS)
    base = deployment.base_url
    name = served_model_name(base)

    def complete(p):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return c.completions.create(
                model=name,
                prompt=p,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
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
