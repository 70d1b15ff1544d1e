"""Ground-floor CUDA helpers: the error raised where no GPU path can run, NVRTC builds, devices.

Importing this package (or any of its modules) never imports ``cuda.bindings`` nor touches a
GPU: CPU-only installs keep working. The CUDA pieces load on first use
(:func:`eaas.runtime.cuda.nvrtc.load_module`) and raise :class:`GpuUnavailableError` with the
reason when there is no usable GPU or CUDA Python stack. Design: ``docs/gpu.md``.

Modules: :mod:`.nvrtc` (build ``native/*.cu`` with NVRTC, cache the cubins, load and launch
them), :mod:`.device` (which data-plane endpoints a compute device allows; pure).
"""

from __future__ import annotations


class GpuUnavailableError(RuntimeError):
    """The GPU path was asked for but cannot run here (no GPU, no cuda-python, no NVRTC)."""


def cuda_available() -> bool:
    """``True`` when torch sees a CUDA device (imports torch, never initialises a context)."""
    # torch imported on call: this package's error type and the pure device checks stay
    # importable without torch
    import torch

    return bool(torch.cuda.is_available())
