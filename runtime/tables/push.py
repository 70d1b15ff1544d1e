"""Receiving a pushed routing table: authentication, validation and the version decision, shared
by the attention clients (:mod:`eaas.runtime.client.table_push`, its HTTP routes) and the expert servers
(:class:`eaas.runtime.server.assignment.TableEndpoint`); the operator checks failure reports with
the same :func:`authorize`.

Protocol (``PUT /routing-table``): body the routing table JSON (:mod:`eaas.runtime.tables.wire`);
header ``Authorization: Bearer <token>``, where the token is the content of the file named by
``--push-token-file`` / ``$EAAS_PUSH_TOKEN_FILE`` (a mounted Secret; re-read when the file
changes, so a rotated Secret takes effect without a restart; surrounding whitespace is ignored).
Refusals are :class:`PushError` (HTTP status, OpenAI-style error object): ``401`` no or wrong
token, ``403`` pushes disabled (no token file: never accepted unauthenticated), ``503`` token file
unreadable, ``413`` body larger than :data:`MAX_TABLE_BYTES`, ``400`` malformed table or one that
does not fit the model, ``409`` (``stale_version``) a version not newer than the one in use.

Pure decisions (:func:`authorize`, :func:`check_push_token`, :func:`parse_pushed_table`,
:func:`push_decision`) and :class:`TablePush`, the attention client's push state; no web
framework here (the operator imports this module and carries none).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.wire import RoutingTableError

log = logging.getLogger("eaas.client.push")

MAX_TABLE_BYTES = 64 << 20  # a pushed body larger than this is refused (413)


class PushError(Exception):
    """A refused push: HTTP ``status``, OpenAI-style ``type_``/``code`` and a message."""

    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type_

    def answer(self, extra: dict | None = None) -> tuple[int, dict[str, Any]]:
        """``(HTTP status, JSON body)``: ``{"error": {message, type, param, code}, **extra}``."""
        body: dict[str, Any] = {
            "error": {"message": self.message, "type": self.type, "param": None, "code": self.code}
        }
        body.update(extra or {})
        return self.status, body

    @property
    def headers(self) -> dict[str, str] | None:
        """Response headers the refusal needs (``WWW-Authenticate`` on 401), else None."""
        return {"WWW-Authenticate": 'Bearer realm="eaas"'} if self.status == 401 else None


def too_large() -> PushError:
    """The 413 for a body over :data:`MAX_TABLE_BYTES`."""
    return PushError(
        413, f"routing table larger than {MAX_TABLE_BYTES} bytes", "invalid_routing_table"
    )


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
    """True when ``header`` is ``Bearer <token>`` (constant-time comparison; scheme any case;
    whitespace around the header and the value ignored; an empty ``token`` never matches)."""
    if not token or not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def check_push_token(token: BearerToken | None, header: str | None, disabled_hint: str) -> None:
    """Authenticate one push.

    Args:
        token: the push token (None: pushes disabled).
        header: the request's ``Authorization`` header.
        disabled_hint: how to enable pushes, for the 403 message (e.g. ``"start the client
            with --push-token-file"``).

    Raises:
        PushError: 403 pushes disabled, 503 token file unreadable, 401 no or wrong token.
    """
    if token is None:
        raise PushError(
            403,
            f"routing-table pushes are disabled: {disabled_hint}",
            "push_disabled",
            "permission_error",
        )
    try:
        secret = token.get()
    except (OSError, ValueError) as exc:
        raise PushError(
            503, f"push token unreadable: {exc}", "token_unavailable", "service_unavailable"
        ) from None
    if not authorize(header, secret):
        raise PushError(
            401, "missing or wrong bearer token", "invalid_token", "authentication_error"
        )


def parse_pushed_table(
    raw: bytes, *, num_experts: int | None = None, moe_layers: Collection[int] | None = None
) -> RoutingTable:
    """Parse and check a pushed routing table against this process's model.

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
    """What an attention client's push routes need (``app.state.table_push``).

    Attributes:
        dispatcher: the receiver (``version``, ``table``, ``set_table``, ``uncovered``; the
            client's dispatcher), None with ``--local-experts``.
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
        check_push_token(
            self.token,
            authorization,
            "start the client with --push-token-file (or EAAS_PUSH_TOKEN_FILE)",
        )
        if self.dispatcher is None:
            raise PushError(
                404,
                "this client runs --local-experts and uses no routing table",
                "no_routing_table",
            )
        if len(raw) > MAX_TABLE_BYTES:
            raise too_large()
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

    def refusal(self, exc: PushError) -> tuple[int, dict[str, Any]]:
        """``(status, body)`` of a refused push; a 409 also names the version in use."""
        if exc.status != 401:
            log.warning("client %s: routing-table push refused: %s", self.client_id, exc.message)
        extra = {}
        if exc.status == 409 and self.dispatcher is not None:
            extra = {"applied_version": self.dispatcher.version}
        return exc.answer(extra)

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
