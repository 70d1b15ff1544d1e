"""GPU data plane: NVRTC-built kernels, grouped expert GEMM, CUDA-graph and overlap helpers.

Importing this package (or any of its modules) never imports ``cuda.bindings`` nor touches a
GPU: CPU-only installs keep working. The CUDA pieces load on first use
(:func:`eaas.runtime.gpu.build.load_module`) and raise :class:`GpuUnavailableError` with the
reason when there is no usable GPU or CUDA Python stack. Design: ``docs/gpu.md``.
"""

from __future__ import annotations


class GpuUnavailableError(RuntimeError):
    """The GPU path was asked for but cannot run here (no GPU, no cuda-python, no NVRTC)."""


def cuda_available() -> bool:
    """``True`` when torch sees a CUDA device (imports torch, never initialises a context)."""
    import torch

    return bool(torch.cuda.is_available())
