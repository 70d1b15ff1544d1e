"""Fixtures for end-to-end tests (helpers in ``e2e_helpers``)."""

from __future__ import annotations

import pytest
import torch

from eaas.runtime.models.tiny import default_model_dir

# The test process computes references next to many server/client processes on few cores: more
# than one intra-op thread only adds contention (measured: 4x slower reference_generate).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(default_model_dir())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
