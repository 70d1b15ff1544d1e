"""Child processes that die with their parent (Linux ``prctl(PR_SET_PDEATHSIG)``)."""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

#: ``prctl`` option: the signal the kernel sends this process when its parent thread exits
#: (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``SIGKILL`` when its
    parent exits, even when the parent is SIGKILLed.

    Args:
        parent: the pid of the spawning process (default: ``os.getpid()`` now). The child
            exits with code 1 at once when its parent already died before ``prctl`` took effect.

    The returned function runs in the child between fork and exec: it only calls ``prctl``
    through a ``libc`` handle loaded here, before the fork. The kernel ties the signal to the
    parent *thread* that forked: spawn from a thread that lives as long as the parent.
    """
    parent = os.getpid() if parent is None else parent
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec
