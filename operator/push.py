"""Push and acknowledge, operator side (the routing table's life cycle: push, then the ConfigMap
watch converges whoever missed it).

Each new routing-table version is PUT to every Ready attention-client pod of every fleet that
uses the pool (``PUT /routing-table``, the protocol of :mod:`eaas.runtime.tables.push`, bearer
token from the fleet's Secret; the call is
:func:`eaas.runtime.tables.http.push_routing_table`). A client's answer is its acknowledgement:
``200`` names the version it applied; ``409`` (stale) names the version it already holds (it got
it from its ConfigMap watch). The operator keeps, per client pod uid, the newest version acknowledged; a pod below the current
version is pushed again on a later reconcile step, so a missed push is retried while the
ConfigMap watch converges the client independently.

Retries back off per client (:func:`push_retry_delay_s`: 1 s, 2 s, 4 s ... capped at 60 s, the
shape of client-go's ``ItemExponentialFailureRateLimiter``): a client that is down (crashed,
SIGSTOPped, partitioned) is not hit every resync, and the reconcile step does not wait out a
push timeout for it each time. The first push of each *new* version goes out at once whatever
the back-off (failover latency matters more than one wasted request); the failure count only
resets when the client acknowledges.

The decisions (:func:`ObservedClient.from_pod`, :func:`clients_to_push`, :func:`acknowledged`,
:func:`push_retry_delay_s`, :func:`push_due`, :func:`after_push`) are pure; :func:`push_all`
does the I/O on a thread pool.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from eaas.runtime.tables.http import PushResult, push_routing_table

log = logging.getLogger("eaas.operator.push")

#: Connect + read timeout of one push (s): a client applies a table within one MoE layer call.
PUSH_TIMEOUT_S = 3.0


#: First retry delay of an unacknowledged push (s); doubles per failure up to the cap.
PUSH_RETRY_BASE_S = 1.0
#: Largest retry delay (s): a client down for long is still retried once a minute (its
#: ConfigMap watch converges it anyway when it comes back).
PUSH_RETRY_CAP_S = 60.0


@dataclass(frozen=True)
class PushRetry:
    """Back-off state of one client (pod uid).

    Attributes:
        failures: consecutive unacknowledged pushes (>= 1).
        version: table version of the last failed push.
        next_at: monotonic time (s) before which that version is not pushed again.
    """

    failures: int
    version: int
    next_at: float


def push_retry_delay_s(
    failures: int, base_s: float = PUSH_RETRY_BASE_S, cap_s: float = PUSH_RETRY_CAP_S
) -> float:
    """Delay (s) before retrying a client after ``failures`` consecutive failed pushes:
    ``min(cap_s, base_s * 2**(failures - 1))``; 0 for ``failures <= 0``."""
    if failures <= 0:
        return 0.0
    return min(cap_s, base_s * 2.0 ** min(failures - 1, 62))


def push_due(retry: PushRetry | None, version: int, now: float) -> bool:
    """Whether a client with back-off state ``retry`` may be pushed ``version`` at ``now``
    (monotonic s): no failures, a version newer than the one that failed, or the delay is over."""
    return retry is None or version > retry.version or now >= retry.next_at


def after_push(retry: PushRetry | None, version: int, ok: bool, now: float) -> PushRetry | None:
    """Back-off state after a push of ``version`` at ``now``: None when acknowledged (``ok``),
    else one more failure and the next allowed time."""
    if ok:
        return None
    failures = (retry.failures if retry is not None else 0) + 1
    return PushRetry(failures, version, now + push_retry_delay_s(failures))


@dataclass(frozen=True)
class ObservedClient:
    """An attention-client pod as the pusher sees it.

    Attributes:
        name, uid: pod identity (acknowledgements are kept per uid: a replacement starts at 0).
        ip: pod IP ("" before it has one).
        ready: the pod's Ready condition is True and it is not terminating.
    """

    name: str
    uid: str
    ip: str
    ready: bool

    @classmethod
    def from_pod(cls, pod: Mapping[str, Any]) -> ObservedClient:
        """Parse a pod as the API returns it (camelCase JSON dict)."""
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        ready = not meta.get("deletionTimestamp") and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (status.get("conditions") or [])
        )
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            ip=status.get("podIP") or "",
            ready=bool(ready),
        )


def clients_to_push(
    clients: Sequence[ObservedClient],
    acks: Mapping[str, int],
    version: int,
    retries: Mapping[str, PushRetry] | None = None,
    now: float = 0.0,
) -> list[ObservedClient]:
    """Ready clients with an IP that have not acknowledged ``version`` (or newer) yet and are
    not backing off (:func:`push_due`).

    Args:
        clients: the fleet's client pods.
        acks: pod uid -> newest version that pod acknowledged.
        version: the version in the routing-table ConfigMap (0: none, nothing to push).
        retries: pod uid -> back-off state (None: no back-off).
        now: monotonic time (s) to compare with the back-off.
    """
    if version <= 0:
        return []
    retries = retries or {}
    return [
        c
        for c in clients
        if c.ready
        and c.ip
        and acks.get(c.uid, 0) < version
        and push_due(retries.get(c.uid), version, now)
    ]


def acknowledged(result: PushResult) -> int | None:
    """The version a push answer shows the client holds: ``200`` -> the acknowledged version,
    ``409`` (stale) -> the version it already applied; anything else -> None (no news)."""
    if result.status == 200 and result.acknowledged_version is not None:
        return int(result.acknowledged_version)
    if result.status == 409 and result.applied_version is not None:
        return int(result.applied_version)
    return None


def push_all(
    clients: Sequence[ObservedClient],
    port: int,
    table_json: str,
    token: str,
    acks: MutableMapping[str, int],
    executor: concurrent.futures.Executor,
    timeout_s: float = PUSH_TIMEOUT_S,
    retries: MutableMapping[str, PushRetry] | None = None,
    version: int = 0,
    now: float = 0.0,
) -> dict[str, str]:
    """PUT ``table_json`` (version ``version``) to each client concurrently and record
    acknowledgements in ``acks`` and, when ``retries`` is given, each client's back-off state
    (:func:`after_push` at ``now``, monotonic s).

    Returns:
        pod name -> outcome for each push that was not acknowledged (HTTP status and message,
        or the connection error): a 401 means the client holds another token (Secret not yet
        refreshed in the pod).
    """

    def one(c: ObservedClient) -> tuple[ObservedClient, PushResult | None, str]:
        try:
            return c, push_routing_table(f"http://{c.ip}:{port}", table_json, token, timeout_s), ""
        except OSError as exc:
            return c, None, f"unreachable: {exc}"

    failures: dict[str, str] = {}
    for c, result, err in executor.map(one, clients):
        applied = acknowledged(result) if result is not None else None
        if applied is not None:
            acks[c.uid] = max(acks.get(c.uid, 0), applied)
        else:
            failures[c.name] = f"{result.status}: {result.message}" if result is not None else err
        if retries is not None:
            backoff = after_push(retries.get(c.uid), version, applied is not None, now)
            if backoff is None:
                retries.pop(c.uid, None)
            else:
                retries[c.uid] = backoff
    return failures
