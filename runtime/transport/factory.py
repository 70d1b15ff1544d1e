"""Open a transport by endpoint scheme: the one place that knows every implementation.

``connect(endpoint, ...)`` gives the client end, ``listen(endpoint, ...)`` the server end. The
interface (:mod:`.base`) imports no implementation and every implementation imports only
:mod:`.base` and :mod:`.sockets`, so there is no import circle; the implementation module is
imported on first use.

A new transport is one line in :data:`TRANSPORTS`: its endpoint prefix, module, client class
and listener class.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from eaas.runtime.transport.base import ClientConnection, ServerListener

# endpoint prefix -> (module, client connection class, server listener class)
TRANSPORTS: dict[str, tuple[str, str, str]] = {
    "unix:": ("eaas.runtime.transport.shm", "ShmClientConnection", "ShmServerListener"),
    "tcp://": ("eaas.runtime.transport.tcp", "TcpClientConnection", "TcpServerListener"),
    # GPU transports (docs/gpu.md): CUDA IPC on one node, NVSHMEM across nodes
    "cudaipc:": (
        "eaas.runtime.transport.cuda_ipc",
        "CudaIpcClientConnection",
        "CudaIpcServerListener",
    ),
    "nvshmem:": (
        "eaas.runtime.transport.nvshmem",
        "NvshmemClientConnection",
        "NvshmemServerListener",
    ),
}


def _resolve(endpoint: str, which: int) -> Any:
    """The class for ``endpoint``'s scheme: ``which`` 1 = client, 2 = listener.

    Raises:
        ValueError: no transport has this endpoint's prefix.
    """
    for prefix, entry in TRANSPORTS.items():
        if endpoint.startswith(prefix):
            return getattr(importlib.import_module(entry[0]), entry[which])
    known = ", ".join(f"{p}..." for p in TRANSPORTS)
    raise ValueError(f"unknown endpoint scheme in {endpoint!r} (expected one of: {known})")


def connect(
    endpoint: str, server_id: str, *, hidden_size: int, dtype: torch.dtype, **kw: Any
) -> ClientConnection:
    """Open a client connection to the expert server at ``endpoint``.

    Args:
        endpoint: ``unix:PATH`` (shared memory, same host) or ``tcp://HOST:PORT``.
        server_id: the server's id (error messages, dispatcher bookkeeping).
        hidden_size: ``H`` of every frame; dtype: activation dtype (float32 or bfloat16).
        kw: transport options (``client_id``, ``connect_timeout``, ``spin_us``, ...).

    Raises:
        ValueError: unknown scheme. The transport's own :class:`PeerDeadError`,
        :class:`DeadlineExceeded` or :class:`FrameError` when the connection fails.
    """
    cls = _resolve(endpoint, 1)
    conn: ClientConnection = cls(endpoint, server_id, hidden_size=hidden_size, dtype=dtype, **kw)
    return conn


def listen(endpoint: str, *, hidden_size: int, dtype: torch.dtype, **kw: Any) -> ServerListener:
    """Open the server end at ``endpoint`` (``unix:PATH`` or ``tcp://HOST:PORT``; port 0 picks
    a free port, see the listener's ``endpoint``).

    Raises:
        ValueError: unknown scheme. OSError: the address is taken or cannot be bound.
    """
    cls = _resolve(endpoint, 2)
    listener: ServerListener = cls(endpoint, hidden_size=hidden_size, dtype=dtype, **kw)
    return listener
