"""What a request must show before any handler reads its body: the API key and a JSON body.

:class:`RequestGuard` (ASGI middleware) answers, in OpenAI's error shape and before the body is
read:

* **401** ``invalid_api_key`` (type ``authentication_error``, header ``WWW-Authenticate:
  Bearer``) when API keys are set (``--api-key`` / ``$EAAS_API_KEY``) and a request to a
  :func:`needs_key` path (every ``/v1/*`` route, ``/tokenize``, ``/detokenize``) lacks
  ``Authorization: Bearer <one of the keys>``. The comparison is constant-time
  (:func:`eaas.runtime.tables.push.authorize`, the project's one bearer check) and every key is
  compared, so the time does not tell which key is closest. ``/health``, ``/metrics``,
  ``/version`` and ``/openapi.json`` stay open (probes and scrapers carry no key; they start no
  generation); ``/routing-table`` has its own push token.
* **415** ``unsupported_media_type`` (``param`` ``Content-Type``) for a ``POST`` to a JSON route
  whose ``Content-Type`` is not ``application/json`` (parameters such as ``charset=utf-8``
  allowed). A web page can make a browser send ``text/plain``, ``multipart/form-data`` or
  ``application/x-www-form-urlencoded`` to any address without a CORS preflight; refusing them
  leaves a cross-site page only ``application/json``, which needs a preflight this server never
  grants (it sends no CORS headers).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request

from eaas.runtime.client.api.protocol import APIError
from eaas.runtime.tables.push import authorize

#: The POST routes whose body is JSON (each refuses another Content-Type with a 415).
JSON_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})

#: The paths outside ``/v1`` that need the API key too (as vLLM's server).
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


def needs_key(path: str) -> bool:
    """Whether a request to ``path`` must carry the API key (when keys are set)."""
    return path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS


def key_accepted(header: str | None, keys: tuple[str, ...]) -> bool:
    """``header`` (``Authorization``) is ``Bearer <k>`` for some ``k`` in ``keys``; every key is
    compared in constant time (no early exit)."""
    ok = False
    for k in keys:
        ok |= authorize(header, k)
    return ok


def is_json_content_type(value: str | None) -> bool:
    """``value`` is ``application/json`` with or without parameters (case-insensitive)."""
    if not value:
        return False
    return value.split(";", 1)[0].strip().lower() == "application/json"


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or wrong API key: send 'Authorization: Bearer <key>' (the server was started "
        "with --api-key / EAAS_API_KEY)",
        "authentication_error",
        None,
        "invalid_api_key",
    )


def unsupported_media_type(value: str | None) -> APIError:
    got = "no Content-Type header" if not value else f"Content-Type {value[:100]!r}"
    return APIError(
        415,
        f"the request body must be JSON with header 'Content-Type: application/json'; got {got}",
        "invalid_request_error",
        "Content-Type",
        "unsupported_media_type",
    )


class RequestGuard:
    """ASGI middleware: the API key and the Content-Type checks (module docstring).

    Args:
        app: the wrapped ASGI app.
        keys: callable returning the accepted API keys (empty: no key needed).
        count: ``count(request, status)``, called for every refusal (the request metric).
    """

    def __init__(
        self,
        app,
        keys: Callable[[], tuple[str, ...]],
        count: Callable[[Request, int], None],
    ):
        self.app = app
        self.keys = keys
        self.count = count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        req = Request(scope)
        keys = self.keys()
        err = None
        if keys and needs_key(path) and not key_accepted(req.headers.get("authorization"), keys):
            err = unauthorized()
        elif scope.get("method") == "POST" and path in JSON_ROUTES:
            ctype = req.headers.get("content-type")
            if not is_json_content_type(ctype):
                err = unsupported_media_type(ctype)
        if err is None:
            await self.app(scope, receive, send)
            return
        self.count(req, err.status)
        response = err.response()
        if err.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="eaas"'
        await response(scope, receive, send)
