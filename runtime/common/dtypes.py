"""The one map between dtype names and ``torch.dtype``.

Names are those of ``--dtype`` and of a checkpoint's ``config.json`` (``dtype`` /
``torch_dtype``, with or without the ``torch.`` prefix). The names are plain strings, so the
operator and the option objects check a ``--dtype`` without importing torch; torch is imported
only by :func:`torch_dtype` and :func:`dtype_name`, which only torch users call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: ``--dtype`` values of the serving processes (weights, activations, KV cache, wire frames).
SERVING_DTYPES = ("float32", "bfloat16")

#: Every name a checkpoint may declare -> the name of its ``torch.dtype``.
DTYPE_ALIASES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


def check_serving_dtype(name: str) -> str:
    """``name`` when it is one of :data:`SERVING_DTYPES`.

    Raises:
        ValueError: ``--dtype must be float32 or bfloat16, got 'NAME'``.
    """
    if name not in SERVING_DTYPES:
        raise ValueError(f"--dtype must be float32 or bfloat16, got {name!r}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of ``name`` (a key of :data:`DTYPE_ALIASES`, ``torch.`` prefix allowed).

    Raises:
        KeyError: an unknown name.
    """
    import torch  # lazy: this module is imported by torch-free code (operator, options)

    return getattr(torch, DTYPE_ALIASES[name.removeprefix("torch.")])


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the inverse of :func:`torch_dtype`)."""
    return str(dtype).removeprefix("torch.")
