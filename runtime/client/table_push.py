"""Push and acknowledge: the operator PUTs each new routing-table version to every attention client.

DESIGN.md "Routing-table life cycle", step 3; issue 6, item 4. Endpoints (mounted on the
attention client's API port by :func:`eaas.runtime.client.api.create_app`):

``PUT /routing-table``
    Body: the routing table JSON (:mod:`eaas.runtime.routing`, the ConfigMap's
    ``routing-table.json``). Header ``Authorization: Bearer <token>``, where the token is the
    content of the file named by ``--push-token-file`` / ``$EAAS_PUSH_TOKEN_FILE`` (a mounted
    Secret; re-read when the file changes, so a rotated Secret takes effect without a restart;
    surrounding whitespace is ignored). Answers:

    * ``200 {"acknowledged_version": V, "client_id": C, "previous_version": P}``: applied
      (through :meth:`Dispatcher.set_table`, which waits for a MoE layer call in progress).
      This answer is the client's acknowledgement.
    * ``401`` (with ``WWW-Authenticate: Bearer``): no or wrong bearer token.
    * ``403``: pushes are disabled (no token file configured): never accepted unauthenticated.
    * ``409`` (``code: "stale_version"``, ``applied_version``): the version is not newer than the
      one in use (older versions are refused; re-pushing the version in use is also 409, so the
      pusher can tell it already holds).
    * ``400`` (``code: "invalid_routing_table"``): malformed JSON or table, or a table that does
      not fit this client's model (``num_experts`` differs, a layer that is not a MoE layer).
      The table in use stays.
    * ``404`` (``code: "no_routing_table"``): this client runs ``--local-experts``.
    * ``503``: the token file is configured but unreadable.

``GET /routing-table``
    ``{"client_id", "version", "num_experts", "servers": {id: endpoint}, "uncovered_experts"}`` of
    the table in use (``version`` 0: none yet). No token needed (the same facts are in
    ``GET /health``).

The pure parts (:func:`authorize`, :func:`parse_pushed_table`, :func:`push_decision`) decide;
the route handlers only do I/O.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from eaas.runtime.routing import RoutingTable, RoutingTableError

log = logging.getLogger("eaas.client.push")

router = APIRouter()

MAX_TABLE_BYTES = 64 << 20  # a pushed body larger than this is refused (413)


class PushError(Exception):
    """A refused push: HTTP ``status``, OpenAI-style ``type_``/``code`` and a message."""

    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type_

    def response(self, extra: dict | None = None) -> JSONResponse:
        body: dict[str, Any] = {
            "error": {"message": self.message, "type": self.type, "param": None, "code": self.code}
        }
        body.update(extra or {})
        headers = {"WWW-Authenticate": 'Bearer realm="eaas"'} if self.status == 401 else None
        return JSONResponse(status_code=self.status, content=body, headers=headers)


class BearerToken:
    """The shared secret in a file (a mounted Secret), re-read when the file changes.

    Args:
        path: file holding the token (whitespace around it ignored).

    Raises (from :meth:`get`):
        OSError: unreadable file; ValueError: empty file.
    """

    def __init__(self, path: str):
        self.path = path
        self._sig: tuple | None = None
        self._token = ""

    def get(self) -> str:
        st = os.stat(self.path)  # follows the ..data symlink a Secret mount swaps on rotation
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if sig != self._sig:
            with open(self.path, encoding="utf-8") as f:
                token = f.read().strip()
            if not token:
                raise ValueError(f"push token file {self.path} is empty")
            self._token, self._sig = token, sig
        return self._token


def authorize(header: str | None, token: str) -> bool:
    """True when ``header`` is ``Bearer <token>`` (constant-time comparison; scheme any case)."""
    if not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def parse_pushed_table(
    raw: bytes, *, num_experts: int | None = None, moe_layers: Collection[int] | None = None
) -> RoutingTable:
    """Parse and check a pushed routing table against this client's model.

    Args:
        raw: request body (UTF-8 JSON).
        num_experts: the model's routed experts per MoE layer (None: not checked).
        moe_layers: the model's MoE layer indices (None: not checked).

    Raises:
        PushError: 400 naming what is wrong (JSON, a table field, a model mismatch).
    """
    try:
        table = RoutingTable.from_json(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PushError(
            400, f"routing table is not UTF-8: {exc}", "invalid_routing_table"
        ) from None
    except RoutingTableError as exc:
        raise PushError(400, str(exc), "invalid_routing_table") from None
    if table.version < 1:
        raise PushError(400, f"version must be >= 1, got {table.version}", "invalid_routing_table")
    if num_experts is not None and table.num_experts != num_experts:
        raise PushError(
            400,
            f"num_experts is {table.num_experts} but this process's model has {num_experts} "
            "routed experts per MoE layer",
            "invalid_routing_table",
        )
    if moe_layers is not None:
        extra = sorted(set(table.layers) - set(moe_layers))
        if extra:
            raise PushError(
                400,
                f"layers {extra[:8]} are not MoE layers of this process's model "
                f"(MoE layers {sorted(moe_layers)})",
                "invalid_routing_table",
            )
    return table


def push_decision(new_version: int, applied_version: int) -> PushError | None:
    """None if ``new_version`` may be applied over ``applied_version``, else the 409 to answer."""
    if new_version <= applied_version:
        return PushError(
            409,
            f"routing table version {new_version} is not newer than version {applied_version} "
            "in use",
            "stale_version",
            "conflict",
        )
    return None


@dataclass
class TablePush:
    """What the routes need; set as ``app.state.table_push`` by the attention client.

    Attributes:
        dispatcher: the client's :class:`~eaas.runtime.client.dispatch.Dispatcher` (None:
            ``--local-experts``).
        token: the push token (None: pushes disabled, every PUT answers 403).
        client_id: shown in answers.
        num_experts / moe_layers: the model's, for :func:`parse_pushed_table`.
    """

    dispatcher: Any
    token: BearerToken | None
    client_id: str
    num_experts: int | None = None
    moe_layers: Collection[int] | None = None

    def handle_put(self, authorization: str | None, raw: bytes) -> tuple[int, dict]:
        """Authenticate, validate and apply one push (blocking: waits for a layer call in
        progress). Returns ``(200, ack body)``; raises :class:`PushError` otherwise."""
        if self.token is None:
            raise PushError(
                403,
                "routing-table pushes are disabled: start the client with --push-token-file "
                "(or EAAS_PUSH_TOKEN_FILE)",
                "push_disabled",
                "permission_error",
            )
        try:
            token = self.token.get()
        except (OSError, ValueError) as exc:
            raise PushError(
                503, f"push token unreadable: {exc}", "token_unavailable", "service_unavailable"
            ) from None
        if not authorize(authorization, token):
            raise PushError(
                401, "missing or wrong bearer token", "invalid_token", "authentication_error"
            )
        if self.dispatcher is None:
            raise PushError(
                404,
                "this client runs --local-experts and uses no routing table",
                "no_routing_table",
            )
        if len(raw) > MAX_TABLE_BYTES:
            raise PushError(
                413, f"routing table larger than {MAX_TABLE_BYTES} bytes", "invalid_routing_table"
            )
        table = parse_pushed_table(raw, num_experts=self.num_experts, moe_layers=self.moe_layers)
        previous = self.dispatcher.version
        refused = push_decision(table.version, previous)
        if refused is not None:
            raise refused
        if not self.dispatcher.set_table(table):  # a newer one won the race meanwhile
            refused = push_decision(table.version, self.dispatcher.version)
            raise refused or PushError(409, "routing table not applied", "stale_version")
        log.info(
            "client %s: pushed routing table version %d applied", self.client_id, table.version
        )
        return 200, {
            "acknowledged_version": table.version,
            "previous_version": previous,
            "client_id": self.client_id,
        }

    def describe(self) -> dict:
        """Body of ``GET /routing-table``."""
        d = self.dispatcher
        table = None if d is None else d.table
        if table is None:
            return {"client_id": self.client_id, "version": 0, "servers": {}, "num_experts": None}
        return {
            "client_id": self.client_id,
            "version": table.version,
            "num_experts": table.num_experts,
            "servers": dict(sorted(table.servers.items())),
            "uncovered_experts": len(d.uncovered()),
        }


@dataclass(frozen=True)
class PushResult:
    """Outcome of :func:`push_routing_table`: HTTP ``status`` and the versions in the answer."""

    status: int
    acknowledged_version: int | None  # set on 200
    applied_version: int | None  # set on 409: the version the client holds
    message: str


def push_routing_table(
    base_url: str, table_json: str | bytes, token: str, timeout_s: float = 5.0
) -> PushResult:
    """The pusher's side (for the operator): PUT one table to one attention client.

    Args:
        base_url: the client's API address, ``http://POD_IP:PORT``.
        table_json: the routing table JSON (:meth:`RoutingTable.to_json`).
        token: the bearer token (the Secret's value).
        timeout_s: connect + read timeout.

    Returns:
        :class:`PushResult` for any HTTP answer (200 acknowledged, 409 stale, 401, 400, ...).

    Raises:
        OSError: the client is unreachable (refused, timed out): it did not acknowledge.
    """
    import json
    import urllib.error
    import urllib.request

    data = table_json.encode() if isinstance(table_json, str) else table_json
    req = urllib.request.Request(
        base_url.rstrip("/") + "/routing-table",
        data=data,
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
    err = body.get("error") or {}
    return PushResult(
        status,
        body.get("acknowledged_version"),
        body.get("applied_version"),
        err.get("message", "") if isinstance(err, dict) else str(err),
    )


def _state(request: Request) -> TablePush | None:
    return getattr(request.app.state, "table_push", None)


@router.put("/routing-table")
async def put_routing_table(request: Request):
    push = _state(request)
    if push is None:
        push = TablePush(None, None, str(getattr(request.app.state.eaas, "client_id", "?")))
    # bounded before it is buffered: a peer without a token must not make us hold any size
    too_large = PushError(
        413, f"routing table larger than {MAX_TABLE_BYTES} bytes", "invalid_routing_table"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_TABLE_BYTES:
        return too_large.response()
    chunks, size = [], 0
    async for chunk in request.stream():  # also bounds a chunked body without a length
        size += len(chunk)
        if size > MAX_TABLE_BYTES:
            return too_large.response()
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        _, body = await asyncio.to_thread(
            push.handle_put, request.headers.get("authorization"), raw
        )
    except PushError as exc:
        if exc.status != 401:
            log.warning("client %s: routing-table push refused: %s", push.client_id, exc.message)
        extra = {}
        if exc.status == 409 and push.dispatcher is not None:
            extra = {"applied_version": push.dispatcher.version}
        return exc.response(extra)
    return JSONResponse(content=body)


@router.get("/routing-table")
async def get_routing_table(request: Request):
    push = _state(request)
    if push is None:
        return {"version": 0, "servers": {}, "num_experts": None}
    return await asyncio.to_thread(push.describe)
