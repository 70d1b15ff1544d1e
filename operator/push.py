"""Push and acknowledge, operator side (issue 6, item 4; DESIGN.md "Routing-table life cycle").

Each new routing-table version is PUT to every Ready attention-client pod of every fleet that
uses the pool (``PUT /routing-table``, the protocol of :mod:`eaas.runtime.client.table_push`,
bearer token from the fleet's Secret; :func:`put_table` speaks it with the standard library
because that module imports fastapi, which the operator image does not carry). A client's answer is its acknowledgement: ``200`` names the version it applied;
``409`` (stale) names the version it already holds (it got it from its ConfigMap watch). The
operator keeps, per client pod uid, the newest version acknowledged; a pod below the current
version is pushed again on the next reconcile step (every resync), so a missed push is retried
while the ConfigMap watch converges the client independently.

The decisions (:func:`ObservedClient.from_pod`, :func:`clients_to_push`, :func:`acknowledged`)
are pure; :func:`push_all` does the I/O on a thread pool.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("eaas.operator.push")

#: Connect + read timeout of one push (s): a client applies a table within one MoE layer call.
PUSH_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class PushResult:
    """A client's answer to a push: HTTP ``status`` and the versions in the answer (the fields
    of :class:`eaas.runtime.client.table_push.PushResult`)."""

    status: int
    acknowledged_version: int | None  # set on 200
    applied_version: int | None  # set on 409: the version the client holds
    message: str


def put_table(base_url: str, table_json: str, token: str, timeout_s: float) -> PushResult:
    """``PUT <base_url>/routing-table`` with the bearer token.

    Returns:
        :class:`PushResult` for any HTTP answer.

    Raises:
        OSError: the client is unreachable (refused, timed out).
    """
    req = urllib.request.Request(
        base_url.rstrip("/") + "/routing-table",
        data=table_json.encode(),
        method="PUT",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    err = body.get("error")
    if not isinstance(err, dict):
        err = {}
    return PushResult(
        status,
        body.get("acknowledged_version"),
        body.get("applied_version"),
        str(err.get("message", "")),
    )


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
    clients: Sequence[ObservedClient], acks: Mapping[str, int], version: int
) -> list[ObservedClient]:
    """Ready clients with an IP that have not acknowledged ``version`` (or newer) yet.

    Args:
        clients: the fleet's client pods.
        acks: pod uid -> newest version that pod acknowledged.
        version: the version in the routing-table ConfigMap (0: none, nothing to push).
    """
    if version <= 0:
        return []
    return [c for c in clients if c.ready and c.ip and acks.get(c.uid, 0) < version]


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
) -> dict[str, str]:
    """PUT ``table_json`` to each client concurrently and record acknowledgements in ``acks``.

    Returns:
        pod name -> outcome for each push that was not acknowledged (HTTP status and message,
        or the connection error): a 401 means the client holds another token (Secret not yet
        refreshed in the pod).
    """

    def one(c: ObservedClient) -> tuple[ObservedClient, PushResult | None, str]:
        try:
            return c, put_table(f"http://{c.ip}:{port}", table_json, token, timeout_s), ""
        except OSError as exc:
            return c, None, f"unreachable: {exc}"

    failures: dict[str, str] = {}
    for c, result, err in executor.map(one, clients):
        version = acknowledged(result) if result is not None else None
        if version is not None:
            acks[c.uid] = max(acks.get(c.uid, 0), version)
        else:
            failures[c.name] = f"{result.status}: {result.message}" if result is not None else err
    return failures
