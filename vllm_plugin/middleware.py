"""``vllm serve --middleware eaas.vllm.middleware.NoLiveReplica503``: a request the plugin's
scheduler ended because an expert it needed had no live replica gets HTTP **503** with an
OpenAI-style error body (``ServiceUnavailableError``), and a stream gets that error as its error
event, instead of vLLM's generic 500 ``Internal server error``; every other response, vLLM's
other 500s included, passes through unchanged.

vLLM 0.32's documented ``--middleware`` adds this pure ASGI class to its API server
(``app.add_middleware``), outside vLLM's exception handlers, so it sees each response as sent.
For ``POST /v1/completions`` and ``POST /v1/chat/completions`` it:

1. learns the request id vLLM will use: the ``X-Request-Id`` header, else the JSON body's
   ``request_id`` (vLLM's own precedence), else it adds an ``X-Request-Id`` of 16 random hex
   digits (what vLLM would draw itself);
2. on a 500 response, or a stream's ``data:`` event with an error of code 500, asks the
   scheduler's record (:class:`~eaas.vllm.failed.FailedRequests`, the directory
   ``EAAS_FAILED_REQUESTS_DIR`` the plugin set) whether the scheduler ended a request of that
   id; if so the
   500 becomes the 503 (the body is replaced, ``Retry-After`` is not set: when a replica comes
   back is the operator's business), else it is sent as it was.

The record is written before the engine core returns the step's outputs, so it is there when
the API server turns them into the 500. Requests on other paths, and everything but those 500s,
are not touched (a body is buffered only when there is no ``X-Request-Id`` header).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from eaas.vllm.failed import FailedRequests

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: the paths whose requests the plugin's scheduler can end (vLLM's OpenAI generation routes;
#: under vLLM's ``--root-path`` the scope's path ends with them)
CHAT = "/v1/chat/completions"
PATHS = ("/v1/completions", CHAT)
#: the body of the 503 (vLLM's ``ErrorResponse`` shape)
MESSAGE = (
    "eaas: 503 no_live_replica: an expert this request's tokens selected has no live replica "
    "(the plugin's /health lists the uncovered experts); retry once the pool covers it again"
)


def error_body() -> dict[str, Any]:
    """The OpenAI-style error object of the 503 (``{"error": {...}}``)."""
    return {
        "error": {
            "message": MESSAGE,
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def _request_id(scope: Scope, receive: Receive) -> tuple[str, Scope, Receive]:
    """(the id vLLM will put in the engine request ids, the scope, the receive to pass on)."""
    rid = _header(scope, b"x-request-id")
    if rid is not None:
        return rid, scope, receive
    chunks: list[bytes] = []
    while True:
        m = await receive()
        if m["type"] != "http.request":  # the client left before sending its body
            return "", scope, _replay([m], receive)
        chunks.append(m.get("body", b""))
        if not m.get("more_body"):
            break
    body = b"".join(chunks)
    replay = _replay([{"type": "http.request", "body": body, "more_body": False}], receive)
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("request_id"), str):
        return parsed["request_id"], scope, replay
    rid = f"{uuid.uuid4().int & (2**64 - 1):016x}"
    headers = [*(scope.get("headers") or ()), (b"x-request-id", rid.encode())]
    return rid, {**scope, "headers": headers}, replay


def _replay(first: list[Message], receive: Receive) -> Receive:
    pending = list(first)

    async def again() -> Message:
        return pending.pop(0) if pending else await receive()

    return again


def _is_500_event(line: bytes) -> bool:
    """Whether a stream line is vLLM's error event with code 500 (``data: {"error": ...}``)."""
    if not line.startswith(b"data: ") or b'"error"' not in line:
        return False
    try:
        ev = json.loads(line[6:])
    except ValueError:
        return False
    return (
        isinstance(ev, dict)
        and isinstance(ev.get("error"), dict)
        and ev["error"].get("code") == 500
    )


def _as_503(chunk: bytes, ours: Callable[[], bool]) -> bytes | None:
    """``chunk`` with its 500 error event replaced by the 503 one, or None (no such event, or
    the request is not one the scheduler recorded)."""
    lines = chunk.split(b"\n")
    hits = [i for i, line in enumerate(lines) if _is_500_event(line)]
    if not hits or not ours():
        return None
    event = b"data: " + json.dumps(error_body()).encode()
    return b"\n".join(event if i in hits else line for i, line in enumerate(lines))


class NoLiveReplica503:
    """The ASGI middleware (see the module docstring).

    Args:
        app: the ASGI app it wraps (vLLM's API server app, given by ``add_middleware``).
        record: the scheduler's record; default: the one ``EAAS_FAILED_REQUESTS_DIR`` names
            (the plugin sets it; unset: every response passes unchanged).
    """

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        record: FailedRequests | None = None,
    ):
        self.app = app
        self.record = record if record is not None else FailedRequests.from_env(os.environ)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or not str(scope.get("path", "")).endswith(PATHS)
        ):
            await self.app(scope, receive, send)
            return
        rid, scope, receive = await _request_id(scope, receive)

        def ours() -> bool:
            if not rid or self.record is None:
                return False
            try:
                return self.record.holds(rid, chat=str(scope["path"]).endswith(CHAT))
            except OSError:
                return False

        held: dict[str, Any] = {"replace": False, "stream": False, "headers": []}

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                if message["status"] == 500 and ours():
                    held["replace"] = True  # the 500's body follows: send the 503 instead
                    held["headers"] = [
                        (k, v)
                        for k, v in message.get("headers") or ()
                        if k.lower() not in (b"content-type", b"content-length")
                    ]
                    return
                ctype = dict(message.get("headers") or ()).get(b"content-type", b"")
                held["stream"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                if held["replace"]:
                    if not message.get("more_body"):
                        await self._send_503(send, held["headers"])
                    return
                if held["stream"] and b"500" in message.get("body", b""):
                    body = _as_503(message["body"], ours)
                    if body is not None:
                        message = {**message, "body": body}
            await send(message)

        await self.app(scope, receive, wrapped)

    @staticmethod
    async def _send_503(send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """The 503 with the 500's other headers (e.g. vLLM's ``X-Request-Id`` echo)."""
        body = json.dumps(error_body()).encode()
        headers = [
            *headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
