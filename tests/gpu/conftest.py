"""GPU tests: ``@pytest.mark.gpu`` ones are skipped, with the reason, where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
