"""A free TCP port for local runs and tests."""

from __future__ import annotations

import socket


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (IPv4) that was free a moment ago: the kernel's pick for port 0.

    Racy by nature (another process may take it before the caller binds); fine for local
    deployments and tests. Raises OSError when ``host`` cannot be bound.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
