"""When ``eaas serve`` starts an exited expert server again: exponential back-off, as the
kubelet's CrashLoopBackOff does for a pod's container.

The first restart comes :data:`FIRST_DELAY_S` after the exit, each further one after twice the
delay before, at most :data:`MAX_DELAY_S`; a server that served (was ready) for
:data:`RESET_AFTER_S` before it exited starts over at the first delay. Pure logic: the
deployment (:mod:`eaas.runtime.serve.deployment`) asks :meth:`RestartBackoff.exited` when to
start it again.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Seconds from an exit to the first restart.
FIRST_DELAY_S = 1.0
#: Longest delay between restarts, seconds.
MAX_DELAY_S = 60.0
#: Seconds a server must have served (ready) before its exit for the back-off to start over.
RESET_AFTER_S = 120.0


@dataclass
class RestartBackoff:
    """The restart schedule of one expert server.

    Attributes:
        first_delay_s / max_delay_s / reset_after_s: the schedule (seconds; module defaults).
        crashes: exits since the back-off last started over (0: none).
        restart_at: ``time.monotonic()`` of the next restart (None: none due).
    """

    first_delay_s: float = FIRST_DELAY_S
    max_delay_s: float = MAX_DELAY_S
    reset_after_s: float = RESET_AFTER_S
    crashes: int = 0
    restart_at: float | None = None

    def delay(self) -> float:
        """Seconds from the latest exit to its restart: ``first * 2**(crashes - 1)``, at most
        ``max_delay_s`` (0 before any exit)."""
        if self.crashes == 0:
            return 0.0
        return min(self.first_delay_s * 2.0 ** min(self.crashes - 1, 64), self.max_delay_s)

    def exited(self, now: float, ready_at: float | None) -> float:
        """Record an exit at ``now`` (``time.monotonic()``) of a server that was ready since
        ``ready_at`` (None: it never got ready); returns the delay until its restart (seconds)
        and sets :attr:`restart_at`."""
        if ready_at is not None and now - ready_at >= self.reset_after_s:
            self.crashes = 0
        self.crashes += 1
        d = self.delay()
        self.restart_at = now + d
        return d

    def due(self, now: float) -> bool:
        """Whether a restart is scheduled for ``now`` or earlier."""
        return self.restart_at is not None and now >= self.restart_at

    def restarted(self) -> None:
        """The restart happened: none due until the next exit."""
        self.restart_at = None
