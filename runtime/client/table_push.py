"""The attention client's routing-table routes, mounted on its API port by
:func:`eaas.runtime.client.api.create_app`; the decisions are :mod:`eaas.runtime.tables.push`.

``PUT /routing-table``
    Body: the routing table JSON (:mod:`eaas.runtime.tables.wire`, the ConfigMap's
    ``routing-table.json``), header ``Authorization: Bearer <token>``. Answers:

    * ``200 {"acknowledged_version": V, "client_id": C, "previous_version": P}``: applied
      (through the dispatcher's ``set_table``, which waits for a MoE layer call in progress).
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
    * ``413``: body larger than :data:`~eaas.runtime.tables.push.MAX_TABLE_BYTES` (refused
      before it is buffered).
    * ``503``: the token file is configured but unreadable.

``GET /routing-table``
    ``{"client_id", "version", "num_experts", "servers": {id: endpoint}, "uncovered_experts"}`` of
    the table in use (``version`` 0: none yet). No token needed (the same facts are in
    ``GET /health``).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from eaas.runtime.tables.push import MAX_TABLE_BYTES, PushError, TablePush, too_large

router = APIRouter()


def _state(request: Request) -> TablePush | None:
    return getattr(request.app.state, "table_push", None)


def _response(exc: PushError, answer: tuple[int, dict] | None = None) -> JSONResponse:
    """The JSON response of a refusal (``answer``: its ``(status, body)``, default the plain one)."""
    status, body = answer or exc.answer()
    return JSONResponse(status_code=status, content=body, headers=exc.headers)


@router.put("/routing-table")
async def put_routing_table(request: Request):
    push = _state(request)
    if push is None:
        push = TablePush(None, None, str(getattr(request.app.state.eaas, "client_id", "?")))
    # bounded before it is buffered: a peer without a token must not make us hold any size
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_TABLE_BYTES:
        return _response(too_large())
    chunks, size = [], 0
    async for chunk in request.stream():  # also bounds a chunked body without a length
        size += len(chunk)
        if size > MAX_TABLE_BYTES:
            return _response(too_large())
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        _, body = await asyncio.to_thread(
            push.handle_put, request.headers.get("authorization"), raw
        )
    except PushError as exc:
        return _response(exc, push.refusal(exc))
    return JSONResponse(content=body)


@router.get("/routing-table")
async def get_routing_table(request: Request):
    push = _state(request)
    if push is None:
        return {"version": 0, "servers": {}, "num_experts": None}
    return await asyncio.to_thread(push.describe)
