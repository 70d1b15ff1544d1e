"""The operator as monitor of the expert servers' liveness.

Attention clients report the expert servers they marked down
(:mod:`eaas.runtime.client.failure_report`) with an authenticated POST to
``<EAAS_OPERATOR_REPORT_URL>/v1/failure-reports/<namespace>/<fleet>`` (bearer token: the
fleet's push token). The operator does not trust one client: it probes the server's own
``GET /health`` (the expert-server container's port named ``http``) and only when that probe
fails too does it take the server out of the routing table (until a later probe answers 200, or
the pod is replaced). Answers (JSON):

* ``200 {"action": "removed"}``: the probe confirmed the failure; the next table drops it;
* ``200 {"action": "kept"}``: the server answered its probe (the client's problem, or a blip);
* ``200 {"action": "ignored", "reason": ...}``: no such expert-server pod (already gone);
* ``400`` malformed report, ``401`` wrong or missing token.

A standby operator (not the Lease holder) forwards the report unchanged to the leader's
advertised URL (:func:`forward_report`; header ``X-EAAS-Forwarded``, so a report is forwarded at
most once) and answers with the leader's answer plus ``X-EAAS-Forwarded-To``; it answers ``503``
only when no leader is known or the leader is unreachable (the client retries later).

The pure parts (:func:`parse_report`, ``bearer_ok`` (the one bearer check,
:func:`eaas.runtime.tables.push.authorize`), :func:`health_url`) decide; the aiohttp handler in
:mod:`eaas.operator.handlers` does the I/O.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eaas.operator.names import SERVER_ROLE
from eaas.runtime.tables.push import authorize as bearer_ok  # noqa: F401  (the one bearer check)

#: Timeout of the operator's own health probe of a reported server (s).
PROBE_TIMEOUT_S = 1.0

#: Timeout of a standby's forward of a report to the leader (s): the leader's own probe
#: (PROBE_TIMEOUT_S) plus two API reads.
FORWARD_TIMEOUT_S = 10.0

#: Header marking a forwarded report (its value: the forwarding replica's identity).
FORWARDED_HEADER = "X-EAAS-Forwarded"

#: Largest report body accepted (bytes).
MAX_REPORT_BYTES = 64 * 1024


@dataclass(frozen=True)
class FailureReport:
    """One client's report (fields of :func:`eaas.runtime.client.failure_report.failure_report`).

    Attributes:
        client_id: the reporting attention client.
        server_id: the expert server it marked down (its pod name).
        endpoint: the endpoint it used, ``tcp://IP:PORT``.
        table_version: the routing-table version the client had.
        reason: what failed.
    """

    client_id: str
    server_id: str
    endpoint: str
    table_version: int
    reason: str


def parse_report(raw: bytes) -> FailureReport:
    """Parse a report body.

    Raises:
        ValueError: not a JSON object, too large, ``server_id`` missing or not a string, or
            ``table_version`` not an integer (the message names the field).
    """
    if len(raw) > MAX_REPORT_BYTES:
        raise ValueError(f"report larger than {MAX_REPORT_BYTES} bytes")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"report is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("report must be a JSON object")
    server_id = body.get("server_id")
    if not isinstance(server_id, str) or not server_id:
        raise ValueError("server_id: a non-empty string is required")
    version = body.get("table_version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError("table_version: an integer is required")
    return FailureReport(
        client_id=str(body.get("client_id", "")),
        server_id=server_id,
        endpoint=str(body.get("endpoint", "")),
        table_version=version,
        reason=str(body.get("reason", ""))[:500],
    )


def health_url(pod: Mapping[str, Any]) -> str | None:
    """``http://<pod IP>:<port named http>/health`` of an expert-server pod, or None (no IP, no
    such port, or not an expert server)."""
    meta = pod.get("metadata") or {}
    if (meta.get("labels") or {}).get("eaas.io/role") != SERVER_ROLE:
        return None
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") != SERVER_ROLE:
            continue
        for p in c.get("ports") or []:
            if p.get("name") == "http" and p.get("containerPort"):
                return f"http://{ip}:{int(p['containerPort'])}/health"
    return None


def probe_health(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """The operator's own probe: True iff ``GET url`` answers 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def forward_report(
    leader_url: str,
    path: str,
    body: bytes,
    authorization: str | None,
    forwarder: str,
    timeout_s: float = FORWARD_TIMEOUT_S,
) -> tuple[int, bytes]:
    """POST a failure report, as received by a standby, to the leader at ``leader_url``
    (``http://IP:PORT``) under the same ``path``, with the client's ``Authorization``.

    Returns:
        ``(HTTP status, body)`` of the leader's answer (any status).

    Raises:
        OSError: the leader is unreachable (refused, timed out).
    """
    headers = {"Content-Type": "application/json", FORWARDED_HEADER: forwarder or "standby"}
    if authorization:
        headers["Authorization"] = authorization
    req = urllib.request.Request(
        leader_url.rstrip("/") + path, data=body, method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
