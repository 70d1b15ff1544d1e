"""The containers of a pod on a process node: the runtime facts of one container and of its
probes, the local "image"'s environment, restart back-off limits, and exit codes."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

#: The process that enters a container's mount namespace and execs its command (:mod:`.podinit`).
PODINIT = str(Path(__file__).with_name("podinit.py"))
#: Host variables the local "image" keeps (the image's own ENV in a real cluster).
IMAGE_ENV = (
    "HOME",
    "LANG",
    "LC_ALL",
    "TZ",
    "EAAS_CACHE_DIR",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TORCH_HOME",
)
MAX_BACKOFF_S = 300.0
BACKOFF_RESET_S = 600.0  # a container that ran this long restarts its back-off from the base


def exit_code(rc: int) -> int:
    """A container's exit code from a ``Popen.returncode``."""
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128 + N, as a runtime reports


def killpg(pid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pid`` (a container's), if it still exists."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Probe:
    kind: str  # startup | liveness | readiness
    spec: dict
    next_due: float
    successes: int = 0
    failures: int = 0


@dataclass
class Ctr:
    """Runtime facts of one container of a pod."""

    spec: dict
    init: bool = False
    restart_count: int = 0
    crashes: int = 0
    proc: subprocess.Popen | None = None
    started_at: str = ""
    started_mono: float = 0.0
    ever_started: bool = False
    exit_code: int | None = None
    last_state: dict = field(default_factory=dict)
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    next_start: float = 0.0
    ready: bool = False
    started: bool = False
    probes: list[Probe] = field(default_factory=list)
    kill_deadline: float | None = None
    kill_reason: str = ""
    restart_after_kill: bool = True
    env: dict = field(default_factory=dict)
    container_id: str = ""

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.proc is not None
