"""Local processes of the testbed: spawning a component detached from (or dying with) its
caller, liveness checks that guard pid reuse, stopping, and the environment markers that find a
container's escaped descendants (the testbed's stand-in for the cgroups a kubelet would kill)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

#: Environment markers the node agent puts into every container's processes (inherited by
#: whatever they start), so that escaped descendants can be found.
STATE_MARKER = "EAAS_TESTBED_STATE"
POD_MARKER = "EAAS_TESTBED_POD_UID"
CONTAINER_MARKER = "EAAS_TESTBED_CONTAINER"


def find_marked(name: str, value: str) -> list[int]:
    """Pids of the processes whose environment has ``name=value`` (from ``/proc/<pid>/environ``;
    the environment a process started with)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def kill_marked(name: str, value: str) -> list[int]:
    """SIGKILL every process marked ``name=value`` (see :func:`find_marked`); returns them."""
    pids = [p for p in find_marked(name, value) if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def pid_alive(pid: int, binary: str | None = None) -> bool:
    """True if ``pid`` runs and (when given) its executable is ``binary`` (guards pid reuse)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # zombie: our own dead child
                return False
        if binary is not None:
            exe = os.readlink(f"/proc/{pid}/exe")
            return os.path.basename(exe.removesuffix(" (deleted)")) == binary
    except OSError:
        pass
    return True


def agent_alive(pid: int) -> bool:
    """True if ``pid`` runs a node agent (guards pid reuse by checking its command line)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"eaas.testbed.agent" in f.read()
    except OSError:
        return False


def reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our child (tests start it in-process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGKILL the child when the process that started it exits
    (prctl PR_SET_PDEATHSIG), so a killed pytest run leaves no control plane behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def spawn(argv: list[str], log: Path, cwd: Path, attached: bool) -> int:
    """Start ``argv`` in its own session, stdout and stderr appended to ``log``; returns its pid.

    ``attached``: the process dies with the calling process (:func:`die_with_parent`); otherwise
    it outlives the caller.
    """
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
            preexec_fn=die_with_parent if attached else None,
        )
    return proc.pid


def terminate(pid: int, alive: Callable[[int], bool], timeout: float) -> bool:
    """SIGTERM ``pid``, wait up to ``timeout`` s while ``alive(pid)``, then SIGKILL; collect its
    exit status if it is our child. Returns False if it was gone already."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    end = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < end:
        reap(pid)
        time.sleep(0.05)
    if alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(0.1)
    reap(pid)
    return True


def tail(path: Path, n: int = 15) -> str:
    """The last ``n`` lines of a log file ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
