"""Where the dispatcher stages a MoE layer call's hidden states (pure decisions, docs/gpu.md).

Host transports (``shm``, ``tcp``) read frames from host memory, so a call whose hidden states
are on a GPU copies them to the host once. GPU transports take frames where they are: a
``cudaipc`` connection with a CUDA payload copies device-to-device into its IPC buffer and
answers with CUDA tensors; an ``nvshmem`` connection stages into symmetric GPU memory. Their
frames must not make a round trip through host memory.

* :func:`device_frames`: does a connection take frames in GPU memory (its
  ``device_payload`` attribute)?
* :func:`staging_device`: where the call's hidden states and its output accumulator live:
  the caller's CUDA device when it is one and some connection takes device frames, else the
  CPU (today's host path, unchanged).
* :class:`FrameStaging`: per call, the hidden states each connection gets (the staged tensor,
  or one lazily made host copy for host connections) and row indices on the right device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def device_frames(conn: object) -> bool:
    """Whether ``conn`` takes request frames in GPU memory (``cudaipc`` with a CUDA payload,
    ``nvshmem``): its ``device_payload`` attribute; False for host transports and ``None``."""
    return bool(getattr(conn, "device_payload", False))


def staging_device(hidden_device: torch.device, conns: Iterable[object]) -> torch.device:
    """Where a layer call stages its hidden states ``[T, H]`` and accumulates its output.

    Args:
        hidden_device: the device of the caller's hidden states.
        conns: the dispatcher's open connections (``None`` entries allowed).

    Returns:
        ``hidden_device`` when it is a CUDA device and some connection takes device frames
        (:func:`device_frames`); else ``cpu`` (host transports read host memory).
    """
    if hidden_device.type == "cuda" and any(device_frames(c) for c in conns):
        return hidden_device
    return torch.device("cpu")


class FrameStaging:
    """The hidden states of one layer call as each connection wants them.

    Args:
        hidden: ``[T, H]`` staged hidden states (wire dtype, on :func:`staging_device`).

    Attributes:
        host_copies: device-to-host copies made (0 or 1 per call: the copy is shared by every
            host connection of the call).
    """

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden
        self._host: torch.Tensor | None = hidden if hidden.device.type == "cpu" else None
        self.host_copies = 0

    def hidden_for(self, conn: object) -> torch.Tensor:
        """``[T, H]`` for ``conn``: the staged tensor for a device-frame connection (or when
        staged on the host), else a host copy (made once per call)."""
        if self.hidden.device.type == "cpu" or device_frames(conn):
            return self.hidden
        if self._host is None:
            self._host = self.hidden.cpu()  # (T, H)
            self.host_copies += 1
        return self._host

    @staticmethod
    def rows_on(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[n]`` int64 on ``like``'s device (the same tensor when already there)."""
        return rows.to(like.device)
