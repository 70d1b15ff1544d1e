"""Which device a process computes on, and which data-plane endpoints that device allows (pure).

``eaas expert-server --device`` and ``eaas attention-client --device`` take ``auto`` (``cuda``
when torch sees a CUDA device, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``
(:func:`resolve_device` parses them). The GPU transports need the
process to compute on a CUDA device (docs/gpu.md "GPU transports"):

* ``nvshmem:PE``: the symmetric heap and put-with-signal are GPU memory operations, so an
  expert server listening there, or any member of an NVSHMEM world, must be on ``cuda``;
* ``cudaipc:PATH`` with a CUDA payload: frames arrive as CUDA tensors; an expert server on
  ``cpu`` accepts only host-emulation clients (``payload="host"``) and refuses a CUDA-payload
  hello with :data:`CPU_SERVER_CUDA_PAYLOAD` (checked by the listener when a client connects).
"""

from __future__ import annotations

import re

import torch

#: Why a ``cudaipc`` listener of an expert server computing on the CPU refuses a CUDA payload.
CPU_SERVER_CUDA_PAYLOAD = (
    "this expert server computes on cpu (--device cpu): a cuda payload needs an expert server "
    "started with --device cuda"
)


def check_listen_device(listen: str, device_type: str) -> None:
    """An expert server's ``--listen`` against its ``--device`` (type ``cpu`` | ``cuda``).

    Raises:
        ValueError: ``nvshmem:`` on a non-CUDA device (the message names both flags).
    """
    if listen.startswith("nvshmem:") and device_type != "cuda":
        raise ValueError(
            f"--listen {listen} needs --device cuda (an NVSHMEM world lives in GPU memory), "
            f"got --device {device_type}"
        )


def check_world_device(device_type: str) -> None:
    """A member of an NVSHMEM world (``--nvshmem-world``) against its ``--device``.

    Raises:
        ValueError: not a CUDA device (the message names both flags).
    """
    if device_type != "cuda":
        raise ValueError(
            f"--nvshmem-world needs --device cuda (an NVSHMEM world lives in GPU memory), "
            f"got --device {device_type}"
        )


def resolve_device(name: str):
    """``torch.device`` for a ``--device`` value.

    ``"auto"``: ``cuda`` when a CUDA device is available, else ``cpu``.

    Raises:
        ValueError: an unknown device string, or ``cuda`` asked for where none is available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) available"
            )
    return dev
