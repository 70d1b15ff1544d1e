"""Double-batch overlap in the engine on a CUDA device (``gpu``): the two micro-batches run on
their own CUDA streams (:class:`~eaas.runtime.client.overlap.MicroBatchStreams`) and greedy tokens
equal overlap off. The tiny DeepSeek-V3 with local experts, so only the GPU is exercised; the
CPU side of the same runner is ``test_overlap_engine.py``.
"""

from __future__ import annotations

import pytest
import torch

from eaas.runtime.client.engine import Engine
from eaas.runtime.models.attention import load_attention_model

from helpers.engine import generate_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

TEXTS = ["Hello world", "The expert server hosts", "Kubernetes", "def main(): print"]


def _generate(eng: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return generate_greedy(eng, prompts, max_tokens, 120)


def test_overlap_on_cuda_streams_equals_overlap_off(model_dir):
    model, tok, _ = load_attention_model(model_dir, torch.float32, device="cuda")
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    want = _generate(Engine(model, tok, client_id="cuda-off"), prompts, 8)
    on = Engine(model, tok, client_id="cuda-on", double_batch_overlap=True)
    assert _generate(on, prompts, 8) == want
    assert on.runner.stats["overlap_steps"] >= 5
