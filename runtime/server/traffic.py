"""An expert server's own record of its traffic: how many request frames it answered, when the
last one came, when it was asked to stop and how many frames it still answered after that.

The operator reads it from ``/health`` (``traffic``) to know that a server leaving the pool has
drained (no frame for a quiet period after every client left it), and the server prints it as
its last line on the way out (:meth:`TrafficRecord.exit_line`), so its log proves when its last
frame came against the pod's deletion.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone


def _iso(t: float | None) -> str:
    if t is None:
        return "never"
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


class TrafficRecord:
    """Counters the serving loop updates (one thread writes; readers see plain floats/ints).

    Attributes:
        frames: request frames answered (any status).
        last_frame_unix: wall-clock time (s since the epoch) the last batch of frames was taken
            up, or None before the first.
        last_frame_mono: the same on ``time.monotonic()`` (for ``idle_s``: immune to clock steps).
        stop_unix: wall-clock time the stop (SIGTERM/SIGINT, :meth:`ExpertServer.stop`) was asked,
            or None.
        frames_after_stop: frames answered after the stop was asked (the final drain: frames
            already sent when the stop came are answered, not dropped).
    """

    def __init__(self) -> None:
        self.frames = 0
        self.last_frame_unix: float | None = None
        self.last_frame_mono: float | None = None
        self.stop_unix: float | None = None
        self.frames_after_stop = 0

    def saw(self, n: int) -> None:
        """``n`` frames were taken up now."""
        self.frames += n
        self.last_frame_unix = time.time()
        self.last_frame_mono = time.monotonic()
        if self.stop_unix is not None:
            self.frames_after_stop += n

    def stopping(self) -> None:
        """The stop was asked now (safe from a signal handler: two assignments)."""
        if self.stop_unix is None:
            self.stop_unix = time.time()

    def idle_s(self) -> float | None:
        """Seconds since the last frame (monotonic), or None if no frame came yet."""
        if self.last_frame_mono is None:
            return None
        return time.monotonic() - self.last_frame_mono

    def describe(self) -> dict:
        """``/health``'s ``traffic``: ``frames``, ``last_frame_unix`` (s, or null),
        ``idle_s`` (s since the last frame, or null), ``stop_unix`` (s, or null)."""
        idle = self.idle_s()
        return {
            "frames": self.frames,
            "last_frame_unix": self.last_frame_unix,
            "idle_s": None if idle is None else round(idle, 3),
            "stop_unix": self.stop_unix,
        }

    def exit_line(self, server_id: str) -> str:
        """``expert-server <id> stopped: frames=<n> last_frame_unix=<t> (<iso>) stop_unix=<t>
        frames_after_stop=<k>``: the server's last log line (``t``: seconds since the epoch,
        ``none`` when absent)."""

        def num(t: float | None) -> str:
            return "none" if t is None else f"{t:.3f}"

        return (
            f"expert-server {server_id} stopped: frames={self.frames} "
            f"last_frame_unix={num(self.last_frame_unix)} ({_iso(self.last_frame_unix)}) "
            f"stop_unix={num(self.stop_unix)} frames_after_stop={self.frames_after_stop}"
        )
