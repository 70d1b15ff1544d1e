"""Operator side of the expert servers' routing table (``spec.placement.assignment:
routing-table``, make-before-break): push a version to a server, read which version's weights it
holds, release old versions. The protocol is the server's
(:class:`eaas.runtime.server.assignment.TableEndpoint` on its HTTP port): ``PUT /routing-table``
and ``POST /routing-table/release`` with the pool's bearer token, ``GET /routing-table``.

Spoken with :func:`eaas.runtime.tables.http.json_call` (standard library: the operator image
carries neither torch nor fastapi).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from eaas.runtime.tables.http import json_call

#: Connect + read timeout of one call to a server (s); the server answers at once (it loads
#: in the background).
SERVER_PUSH_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ServerTableState:
    """What an expert server reports about its routing table.

    Attributes:
        status: HTTP status of the answer (202 accepted, 200, 409 stale, 401, 400, ...).
        assigned_version: newest version it received.
        weights_version: newest version whose experts' weights it holds (its confirmation).
        released_version: versions below this no longer hold weights there.
        load_error: why loading failed ("" if not).
        message: the error message of a refused call.
    """

    status: int
    assigned_version: int = 0
    weights_version: int = 0
    released_version: int = 0
    load_error: str = ""
    message: str = ""


def _call(
    method: str, url: str, body: bytes | None, token: str | None, timeout_s: float
) -> ServerTableState:
    status, doc, message = json_call(method, url, body, token, timeout_s)
    return ServerTableState(
        status=status,
        assigned_version=int(doc.get("assigned_version") or 0),
        weights_version=int(doc.get("weights_version") or 0),
        released_version=int(doc.get("released_version") or 0),
        load_error=str(doc.get("load_error") or ""),
        message=message,
    )


def put_server_table(
    base_url: str, table_json: str, token: str, timeout_s: float = SERVER_PUSH_TIMEOUT_S
) -> ServerTableState:
    """``PUT <base_url>/routing-table``. Raises OSError when the server is unreachable."""
    return _call(
        "PUT", base_url.rstrip("/") + "/routing-table", table_json.encode(), token, timeout_s
    )


def release_server(
    base_url: str, version: int, token: str, timeout_s: float = SERVER_PUSH_TIMEOUT_S
) -> ServerTableState:
    """``POST <base_url>/routing-table/release`` ``{"version": V}``. Raises OSError when
    unreachable."""
    body = json.dumps({"version": int(version)}).encode()
    return _call("POST", base_url.rstrip("/") + "/routing-table/release", body, token, timeout_s)


def get_server_state(base_url: str, timeout_s: float = SERVER_PUSH_TIMEOUT_S) -> ServerTableState:
    """``GET <base_url>/routing-table``. Raises OSError when unreachable."""
    return _call("GET", base_url.rstrip("/") + "/routing-table", None, None, timeout_s)
