"""Small helpers of every tier: wait for a condition by polling it, a free TCP port for a
process a test starts."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Callable

# Ports tests hand to the processes they start come from below Linux's ephemeral range (where
# the kernel picks both bind(port 0) and the local port of every outgoing connection), each
# xdist worker from its own slice, each process walking its slice in turn: a port a test picked
# cannot be taken by another worker's pick, an outgoing connection, or the kernel's pick for a
# server that binds port 0 while the child it was meant for is still starting (seconds, for a
# process that imports torch). The kernel's pick raced exactly so in CI ("Address already in
# use" from an attention client).
_LOW = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (``ip_local_port_range``); Linux's
    default 32768 where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_slice() -> range:
    """This xdist worker's ports: the ``k``-th of ``n`` equal slices of ``[_LOW, ephemeral)``;
    empty when the ephemeral range leaves no room below it."""
    high = _ephemeral_low()
    n = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    k = int(name[2:]) % n if name[2:].isdigit() else 0
    width = max(0, high - _LOW) // n
    return range(_LOW + k * width, _LOW + (k + 1) * width)


_SLICE = _worker_slice()
# start where this process's id points, so two suites run at once rarely walk the same ports
_TURN = itertools.count(os.getpid() * 7919 % len(_SLICE) if _SLICE else 0)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (IPv4) that binds now and that no other test of this run picks:
    the next bindable port of this worker's slice below the kernel's ephemeral range; the
    kernel's pick for port 0 where that range leaves no room below it.

    Raises OSError when the slice has no bindable port, or ``host`` cannot be bound.
    """
    for _ in range(len(_SLICE)):
        port = _SLICE[next(_TURN) % len(_SLICE)]
        if _bindable(host, port):
            return port
    if _SLICE:
        raise OSError(f"no bindable port on {host} in {_SLICE.start}-{_SLICE.stop - 1}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], object], timeout: float = 5.0, step: float = 0.01) -> bool:
    """Poll ``cond()`` every ``step`` seconds until it is true or ``timeout`` seconds passed;
    returns whether it became true (its value at the deadline)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())
