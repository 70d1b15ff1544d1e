"""The one HTTP call of the table plane: a JSON request with a bearer token and a timeout, standard
library only (the operator's pushes to attention clients and expert servers, the clients'
failure reports, tests), and :func:`push_routing_table`, the pusher's side of
``PUT /routing-table`` (:mod:`eaas.runtime.tables.push`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


def json_call(
    method: str, url: str, body: bytes | None, token: str | None, timeout_s: float
) -> tuple[int, dict[str, Any], str]:
    """One JSON request with an optional bearer token.

    Args:
        method: ``GET``, ``PUT``, ``POST``.
        url: full URL.
        body: request body (JSON bytes) or None.
        token: sent as ``Authorization: Bearer <token>`` (None: no header).
        timeout_s: connect + read timeout (s).

    Returns:
        ``(HTTP status, JSON object of the answer ({} when it is none), the message of its
        error object ("" without one))`` for any HTTP answer, error statuses included.

    Raises:
        OSError: unreachable (refused, timed out).
    """
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    err = doc.get("error")
    message = str(err.get("message", "")) if isinstance(err, dict) else str(err or "")
    return status, doc, message


@dataclass(frozen=True)
class PushResult:
    """An attention client's answer to a push: HTTP ``status`` and the versions in it."""

    status: int
    acknowledged_version: int | None  # set on 200
    applied_version: int | None  # set on 409: the version the client holds
    message: str


def push_routing_table(
    base_url: str, table_json: str | bytes, token: str, timeout_s: float = 5.0
) -> PushResult:
    """PUT one table to one attention client (``PUT <base_url>/routing-table``).

    Args:
        base_url: the client's API address, ``http://POD_IP:PORT``.
        table_json: the routing table JSON (:meth:`RoutingTable.to_json`).
        token: the bearer token (the Secret's value).
        timeout_s: connect + read timeout (s).

    Returns:
        :class:`PushResult` for any HTTP answer (200 acknowledged, 409 stale, 401, 400, ...).

    Raises:
        OSError: the client is unreachable (refused, timed out): it did not acknowledge.
    """
    data = table_json.encode() if isinstance(table_json, str) else table_json
    status, body, message = json_call(
        "PUT", base_url.rstrip("/") + "/routing-table", data, token, timeout_s
    )
    return PushResult(
        status, body.get("acknowledged_version"), body.get("applied_version"), message
    )
