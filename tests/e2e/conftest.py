"""End-to-end tests (helpers in :mod:`helpers.e2e`; the checkpoint fixtures ``model_dir`` and
``tokenizer`` are the root conftest's)."""

from __future__ import annotations

import torch

# The test process computes references next to many server/client processes on few cores: more
# than one intra-op thread only adds contention (measured: 4x slower reference_generate).
torch.set_num_threads(1)
