"""Wait until a dispatcher has a connection to every expert server of its routing table.

:class:`~eaas.runtime.client.dispatch.Dispatcher` opens its connections on a background
connector thread, and a layer call waits for a connection still being opened only when some
selected expert has no connected replica at all. A call made while one replica's first
connection is still opening therefore goes to the other replicas alone: a test that expects
every replica / every server to get traffic (alternation, load split, per-server counts, a
failover from a server it kills or stops) waits with :func:`wait_all_connected` first.

Shared by ``tests/runtime``, ``tests/e2e`` and ``tests/gpu``.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def all_connected(health: dict) -> bool:
    """Whether every server of ``health`` (:meth:`Dispatcher.health`, or the attention client's
    ``GET /health`` JSON, which includes it) is in state ``connected``."""
    servers = health.get("servers") or {}
    return bool(servers) and all(s["state"] == "connected" for s in servers.values())


def wait_all_connected(
    health: Callable[[], dict], timeout: float = 60.0, step: float = 0.02
) -> dict:
    """Poll ``health()`` until :func:`all_connected`; returns that health. Fails
    (AssertionError with the last health) after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        h = health()
        if all_connected(h):
            return h
        assert time.monotonic() < end, f"not every server connected after {timeout} s: {h}"
        time.sleep(step)
