"""Small helpers of every tier: wait for a condition by polling it, a free TCP port (the
runtime's :func:`eaas.runtime.common.ports.free_tcp_port`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from eaas.runtime.common.ports import free_tcp_port as free_port  # noqa: F401  (tests take it from here)


def wait_until(cond: Callable[[], object], timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll ``cond()`` every ``step`` seconds until it is true or ``timeout`` seconds passed;
    returns whether it became true (its value at the deadline)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())
