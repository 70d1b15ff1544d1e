"""Elastic membership of a ``routing-table`` pool, as decisions: when a new ``spec.replicas`` is
acted on (settle), which live servers leave to be replaced, and when a leaving server has
drained and may be deleted.

A server leaves the pool (scale-down, or re-placement of a live server whose pod is outdated) in
this order, and only then is its pod deleted:

1. it is left out of a routing table the survivors confirmed (they load its experts), and that
   table is published;
2. every client acknowledged that table (so no client picks it for a new frame);
3. it drained: by its own record (``/health`` ``traffic``, :mod:`eaas.runtime.server.traffic`)
   it answered no frame for ``drain_quiet_s``: what was in flight when the clients switched
   has been answered. A server that does not answer at all serves nothing (drained); one that
   keeps getting frames (a client the operator does not know of) is deleted after
   ``drain_timeout_s`` (a Warning event says so). On SIGTERM the server still answers the
   frames already sent (:data:`eaas.runtime.server.server.FINAL_DRAIN_S`).

Settle: a burst of changes of ``spec.replicas`` (an autoscaler, a person patching) is acted on
only once a value stood for ``settle_s``: no pod is created for a value that is gone before it
could serve, and a leaving server that is wanted again before its pod is deleted simply stays.
Pure functions and the pool's memory of them; the I/O is :mod:`eaas.operator.reconcile.drain`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from eaas.operator.pods import ObservedPod


@dataclass
class ElasticMemory:
    """What a pool's steps remember about replica changes and leaving servers.

    Attributes:
        settled: the ``spec.replicas`` acted on (None: not seen yet).
        wanted: the ``spec.replicas`` last seen, and ``wanted_since`` its monotonic time (s).
        drains: pod uid -> monotonic time (s) its drain began (out of every table, every
            client acknowledged).
        replacing: pod name -> uid of outdated live servers leaving the table to be replaced.
    """

    settled: int | None = None
    wanted: int | None = None
    wanted_since: float = 0.0
    drains: dict[str, float] = field(default_factory=dict)
    replacing: dict[str, str] = field(default_factory=dict)

    def busy(self) -> bool:
        """A replica change not acted on yet, or a server leaving: steps every ``resync_s``."""
        return self.settled != self.wanted or bool(self.drains) or bool(self.replacing)


def settled_replicas(memory: ElasticMemory, wanted: int, now: float, settle_s: float) -> int:
    """The replica count to act on: ``wanted`` once it stood ``settle_s`` seconds (or at once
    the first time a pool is seen, or with ``settle_s`` 0), else the one acted on before.

    Args:
        memory: the pool's memory (updated).
        wanted: ``spec.replicas`` now.
        now: ``time.monotonic()`` (s).
        settle_s: the settle time (s, >= 0).
    """
    if memory.settled is None or settle_s <= 0:
        memory.settled = memory.wanted = wanted
        memory.wanted_since = now
        return wanted
    if memory.wanted != wanted:
        memory.wanted, memory.wanted_since = wanted, now
    if memory.settled != wanted and now - memory.wanted_since >= settle_s:
        memory.settled = wanted
    return memory.settled


@dataclass(frozen=True)
class TrafficReport:
    """A leaving server's answer about its traffic (its ``/health`` ``traffic``).

    Attributes:
        reachable: it answered at all.
        frames: frames it answered since it started.
        idle_s: seconds since its last frame (None: none yet).
        last_frame_unix: wall-clock time of its last frame (s since the epoch; None: none).
    """

    reachable: bool
    frames: int = 0
    idle_s: float | None = None
    last_frame_unix: float | None = None

    @classmethod
    def from_health(cls, doc: Mapping[str, object]) -> TrafficReport:
        """From a ``/health`` JSON body (a server without a ``traffic`` record: never busy)."""
        t = doc.get("traffic")
        if not isinstance(t, Mapping):
            return cls(reachable=True)
        idle, last = t.get("idle_s"), t.get("last_frame_unix")
        frames = t.get("frames")
        return cls(
            reachable=True,
            frames=int(frames) if isinstance(frames, int | float) else 0,
            idle_s=float(idle) if isinstance(idle, int | float) else None,
            last_frame_unix=float(last) if isinstance(last, int | float) else None,
        )


def drain_done(report: TrafficReport, waited_s: float, quiet_s: float, timeout_s: float) -> str:
    """Whether a leaving server has drained: ``"quiet"`` (no frame for ``quiet_s``, or none
    ever), ``"unreachable"``, ``"timeout"`` (draining for ``timeout_s``), or ``""`` (not yet).

    Args:
        report: what it says of its traffic.
        waited_s: seconds since its drain began.
        quiet_s, timeout_s: :class:`eaas.operator.settings.ElasticSettings`.
    """
    if not report.reachable:
        return "unreachable"
    if report.idle_s is None or report.idle_s >= quiet_s:
        return "quiet"
    if waited_s >= timeout_s:
        return "timeout"
    return ""


def leaving_servers(
    observed: Sequence[ObservedPod],
    desired_hash: Mapping[str, str],
    in_use: Collection[str],
) -> list[ObservedPod]:
    """The live pods that are to go (excess: not desired; outdated: their spec hash differs)
    and that no client can still pick: not in ``in_use`` (the published and pending tables'
    servers, or every pod while some client is on an older table)."""
    return [
        p
        for p in observed
        if p.live
        and not p.terminating
        and p.name not in in_use
        and (p.name not in desired_hash or desired_hash[p.name] != p.spec_hash)
    ]


def pick_replacements(
    observed: Sequence[ObservedPod],
    desired_hash: Mapping[str, str],
    replacing: Mapping[str, str],
    redundancy: int,
) -> dict[str, str]:
    """Outdated live servers to take out of the table so their pods can be replaced (name ->
    uid): those already leaving that still exist; when none is, and every desired server is live
    and up, up to ``max(1, redundancy - 1)`` more, lowest index first, keeping at least
    ``redundancy`` live up-to-date-or-staying members."""
    by_name = {p.name: p for p in observed}
    kept = {
        n: uid
        for n, uid in replacing.items()
        if (p := by_name.get(n)) is not None and p.uid == uid and not p.terminating
    }
    if kept:
        return kept
    desired = [by_name.get(n) for n in desired_hash]
    if any(p is None or not p.live or p.terminating for p in desired):
        return {}
    outdated = sorted(
        (p for p in desired if p is not None and p.spec_hash != desired_hash[p.name]),
        key=lambda p: p.index,
    )
    room = len(desired) - redundancy
    take = outdated[: max(0, min(max(1, redundancy - 1), room))]
    return {p.name: p.uid for p in take}
