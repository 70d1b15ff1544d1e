"""Wait for a condition by polling it (for tests whose condition is set by another thread or
process)."""

from __future__ import annotations

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
