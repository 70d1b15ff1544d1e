"""Pod networks of parallel testbeds: every live testbed claims its own second octet ``net`` of
the pod IPs 127.<net>.<node>.<n>, so two testbeds on one machine never hand out the same pod IP."""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

from .procs import pid_alive
from .record import Testbed, TestbedError, load


def pod_net_dir() -> Path:
    """The folder of the claim files, ``<tmp>/eaas-testbed-pod-nets``."""
    return Path(tempfile.gettempdir()) / "eaas-testbed-pod-nets"


def _claim_alive(text: str) -> bool:
    """Whether a claim file's ``<pid> <state dir>`` still stands: its claimer runs, or the
    testbed recorded in that state dir has a live component."""
    pid, _, other = text.partition(" ")
    try:
        os.kill(int(pid), 0)
        return True
    except (ValueError, ProcessLookupError):
        pass
    except PermissionError:
        return True
    tb = load(Path(other)) if other else None
    return tb is not None and any(pid_alive(p, n) for n, p in tb.pids.items())


def _nets_in_use() -> set[int]:
    """Second octets of 127.x.y.z addresses that local TCP sockets are bound to (testbeds that
    hold no claim: older versions, or a claim file removed by hand)."""
    used = set()
    for table in ("/proc/net/tcp",):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            ip_hex = line.split()[1].split(":")[0]
            ip = socket.inet_ntoa(int(ip_hex, 16).to_bytes(4, "little"))
            a, b, _, _ = ip.split(".")
            if a == "127" and ip != "127.0.0.1":
                used.add(int(b))
    return used


def claim_pod_net(state_dir: Path) -> int:
    """Claim the second octet ``net`` of this testbed's pod IPs (127.<net>.<node>.<n>): the
    lowest in 1..254 that no live testbed holds (claim files ``<tmp>/eaas-testbed-pod-nets/
    <net>`` holding ``<pid> <state dir>``, under an flock) and no local TCP socket is bound in.
    Released by :func:`release_pod_net` (at ``down``).

    Raises:
        TestbedError: all 254 are taken.
    """
    d = pod_net_dir()
    d.mkdir(exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        busy = _nets_in_use()
        for net in range(1, 255):
            f = d / str(net)
            own = False
            if f.exists():
                text = f.read_text().strip()
                own = text.partition(" ")[2] == str(state_dir)
                if not own and _claim_alive(text):
                    continue
            if net in busy and not own:
                continue
            f.write_text(f"{os.getpid()} {state_dir}")
            return net
    raise TestbedError("no free pod network 127.<net>.0.0/16 (254 testbeds alive?)")


def release_pod_net(tb: Testbed) -> None:
    """Drop this testbed's claim on its pod network (if still its own)."""
    f = pod_net_dir() / str(tb.pod_net)
    try:
        if f.read_text().strip().partition(" ")[2] == str(tb.state_dir):
            f.unlink()
    except OSError:
        pass
