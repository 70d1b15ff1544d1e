"""Small helpers of every tier: wait for a condition by polling it, a free TCP port."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll ``cond()`` every ``step`` seconds until it is true or ``timeout`` seconds passed;
    returns whether it became true (its value at the deadline)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (bound to port 0, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
