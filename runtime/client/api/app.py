"""OpenAI-compatible HTTP API of one attention client (FastAPI): routes and error handling.

The API is split by concern, as vLLM splits its server: :mod:`.protocol` (request and response
bodies as pydantic models, validation into OpenAI-style 400s), :mod:`.prepare` (request bodies
to engine inputs, tokenize/detokenize), :mod:`.chat_template`, :mod:`.logprobs`,
:mod:`.responses` (errors, non-streamed bodies), :mod:`.streaming` (SSE, disconnects),
:mod:`.server` (:class:`OpenAIServer`: the state the handlers share, generation),
:mod:`eaas.runtime.client.sampling` (logits processors and sampling) and this module (routes,
JSON parsing, error handlers).

Endpoints:

* ``POST /v1/completions`` -- ``prompt`` is a string, a list of token ids, or a list of those
  (one choice group per prompt).
* ``POST /v1/chat/completions`` -- ``messages`` rendered with the tokenizer's chat template.
* Request fields of both (OpenAI's plus vLLM's extensions): ``model``, ``max_tokens`` (chat also
  ``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``n``, ``seed``,
  ``stop``, ``stop_token_ids``, ``include_stop_str_in_output``, ``min_tokens``,
  ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``,
  ``ignore_eos``, ``skip_special_tokens``, ``stream``, ``stream_options`` (``include_usage``,
  ``continuous_usage_stats``), ``return_tokens_as_token_ids`` (with logprobs); completions:
  ``echo``, ``logprobs`` (int); chat: ``logprobs`` (bool), ``top_logprobs``,
  ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``.
* ``stream: true`` answers Server-Sent Events in OpenAI's chunk format ending with
  ``data: [DONE]``. A client that disconnects cancels its sequences (they leave the decode batch
  at the next engine step); non-streaming requests poll for the disconnect every
  ``streaming.DISCONNECT_POLL_S`` while decoding.
* ``POST /tokenize`` (``{"model", "prompt"}`` or ``{"model", "messages"}``), ``POST /detokenize``
  (``{"model", "tokens"}``), ``GET /version`` -- vLLM's shapes.
* ``GET /v1/models``, ``GET /health`` (also ``HEAD``; JSON: model, client id, routing table version in use =
  acknowledgement, running/waiting sequences, per-expert-server state, ``uncovered_experts``;
  503 with ``status: "degraded"`` while some (layer, expert) has no live replica, so readiness
  probes route elsewhere), ``GET /metrics`` (Prometheus; merged over all processes under
  ``eaas serve``).

Non-standard additions: every choice carries ``token_ids`` (the generated token ids; in streamed
chunks the ids of that chunk) and vLLM's ``stop_reason`` (matched stop string or stop token id).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` naming the field for malformed JSON, wrong types, out-of-range values,
unknown fields (``unrecognized_parameter``), known but unsupported fields such as ``tools``,
``response_format``, ``suffix``, ``best_of`` != ``n`` (``unsupported_parameter``),
``stream_options`` without ``stream``, token ids outside the model's vocabulary (also when the
tokenizer produced them), context overflow (``context_length_exceeded``), a string or field name holding a lone UTF-16
surrogate escape (``param`` its path), an integer of more than 4300 digits (``invalid_json``); 404
``model_not_found`` for a model name this server does not serve; 413 ``request_too_large`` for
a body over ``OpenAIServer.max_request_body`` (``--max-request-body``); 503
``service_unavailable`` when an expert has no live replica (``no_live_replica``) or the client is
shutting down (``server_shutting_down``), both retryable; 500 ``internal_error`` (same JSON
shape) for anything unexpected. ``eaas_requests_total{client_id, status}`` counts completions and
chats refused by these handlers beside the ones :class:`OpenAIServer` answers. Body parsing and
tokenization run in worker threads (a huge prompt does not stall ``/health``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaas.runtime import metrics
from eaas.runtime.client.api.bodies import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from eaas.runtime.client.api.guard import RequestGuard
from eaas.runtime.client.api.openapi import install_openapi, route_doc
from eaas.runtime.client.api.protocol import APIError, bad
from eaas.runtime.client.api.responses import json_bytes, json_bytes_with_array
from eaas.runtime.client.api.server import OpenAIServer
from eaas.runtime.client.table_push import router as table_push_router

log = logging.getLogger("eaas.client.api")

# the routes whose answers eaas_requests_total counts
_GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return APIError(status, message, type_, param, code).response()


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"request body of {size} bytes is larger than the limit of {limit} bytes "
        "(attention-client --max-request-body)",
        "invalid_request_error",
        None,
        "request_too_large",
    )


# a JSON escape of a UTF-16 surrogate (\uD800-\uDFFF): a pair is an astral character, a lone
# one decodes to a Python str that cannot be encoded (tokenizers and JSON responses fail on it)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes) -> Any:
    """The JSON value of a request body, which must be UTF-8 (RFC 8259 section 8.1).

    ``json.loads`` on bytes would also take UTF-16/32 and decode with ``surrogatepass``, so an
    encoded lone surrogate (bytes ``ED A0 80``) would reach the tokenizer as text it cannot
    encode. Strict UTF-8 refuses those bytes; an escaped one (``"\\ud800"``) is found by
    :func:`check_no_lone_surrogates`.

    Raises:
        APIError: 400 ``invalid_json``: not UTF-8, not JSON, an integer of more than 4300 digits
            (Python's limit), nested deeper than Python's recursion limit; a lone surrogate as
            in :func:`check_no_lone_surrogates`.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"request body is not UTF-8 text: {exc}", None, "invalid_json") from None
    try:
        body = json.loads(text)
    except RecursionError:  # Python's json recurses per nesting level (was a 500)
        raise bad("request body is nested too deeply", None, "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, an int of > 4300 digits
        raise bad(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if _SURROGATE_ESCAPE.search(text):  # only an escape can put one in now
        try:
            check_no_lone_surrogates(body)
        except RecursionError:
            raise bad("request body is nested too deeply", None, "invalid_json") from None
    return body


def check_no_lone_surrogates(body: Any, path: str | None = None) -> None:
    """400 naming the first string (value or field name) of a parsed JSON body that holds a lone
    UTF-16 surrogate (``"\\ud800"``): valid JSON, but not Unicode text.

    Raises:
        APIError: 400 ``invalid_request_error``, code ``invalid_value``, ``param`` the field's
            path (``messages[0].content``; for a field name, the object that holds it).
    """
    if isinstance(body, str):
        try:
            body.encode("utf-8")
        except UnicodeEncodeError:
            raise bad(
                f"'{path}' is not valid Unicode text: it holds a lone UTF-16 surrogate "
                "(a \\uD800-\\uDFFF escape without its pair)",
                path,
            ) from None
    elif isinstance(body, dict):
        for key, value in body.items():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                where = f"'{path}'" if path else "the request body"
                raise bad(
                    f"a field name of {where} holds a lone UTF-16 surrogate "
                    "(a \\uD800-\\uDFFF escape without its pair)",
                    path,
                ) from None
            check_no_lone_surrogates(value, key if path is None else f"{path}.{key}")
    elif isinstance(body, list):
        for i, item in enumerate(body):
            check_no_lone_surrogates(item, f"{path}[{i}]")


class _JSONServerErrors:
    """ASGI middleware: an exception no handler answered (a bug) becomes a 500 in OpenAI's JSON
    shape, code ``internal_error``, and the connection stays open.

    Starlette's own last resort answers plain text and re-raises, and uvicorn then closes the
    keep-alive connection, so the client's next request on it fails too. Here the traceback is
    logged and nothing is re-raised. A response already started (a stream) cannot be replaced:
    that exception propagates.
    """

    def __init__(self, app, count):
        self.app = app
        self.count = count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_started(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as exc:
            if started:
                raise
            req = Request(scope)
            log.error("%s %s failed", req.method, req.url.path, exc_info=exc)
            self.count(req, 500)
            response = error_response(
                500,
                f"internal error ({type(exc).__name__}); the server keeps serving",
                "internal_error",
                None,
                "internal_error",
            )
            await response(scope, receive, send)


def _version() -> str:
    try:
        return version("eaas")
    except PackageNotFoundError:
        return "unknown"


def create_app(server: OpenAIServer) -> FastAPI:
    """Build the FastAPI app around ``server`` (see the module docstring for the endpoints)."""
    app = FastAPI(
        title="EaaS attention client",
        version=_version(),
        description="OpenAI-compatible API of one attention client (docs/serving.md 'API').",
        docs_url=None,
        redoc_url=None,
    )
    app.state.eaas = server
    install_openapi(app)

    def count(req: Request, status: int) -> None:
        # a refused completion counts as a request too (generate counts the ones it answers)
        if req.url.path in _GENERATION_ROUTES:
            metrics.REQUESTS.labels(client_id=server.client_id, status=str(status)).inc()

    @app.exception_handler(APIError)
    async def _api_error(req: Request, exc: APIError):
        count(req, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(req: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        count(req, 400)
        return error_response(
            400, f"invalid request: {first.get('msg', str(exc))}", param=loc, code="invalid_value"
        )

    # the key and the Content-Type are checked before any body is read (guard.py); the 500
    # handler wraps everything
    app.add_middleware(RequestGuard, keys=lambda: getattr(server, "api_keys", ()), count=count)
    app.add_middleware(_JSONServerErrors, count=count)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), type_, None, code)

    async def _json_body(request: Request) -> dict:
        limit = server.max_request_body
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():  # also bounds a chunked body without a length
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        raw = b"".join(chunks)
        # off the event loop: parsing a body of many MiB would stall /health and every stream
        body = (
            await asyncio.to_thread(parse_json_body, raw)
            if size > 1 << 20
            else parse_json_body(raw)
        )
        if not isinstance(body, dict):
            raise bad("request body must be a JSON object", None, "invalid_json")
        return body

    app.include_router(table_push_router)  # PUT/GET /routing-table: push and acknowledge

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=server.created, max_model_len=server.max_context)

    @app.get("/v1/models", **route_doc("list_models", ModelList, (401,)))
    async def models():
        names = (server.model_name, *getattr(server, "aliases", ()))
        return ModelList(data=[model_card(n) for n in names]).model_dump()

    @app.get("/v1/models/{model_id:path}", **route_doc("retrieve_model", ModelCard, (401, 404)))
    async def retrieve_model(model_id: str):
        server.requests.check_model(model_id or None)  # 404 model_not_found for another id
        return model_card(model_id or server.model_name).model_dump()

    @app.get("/version", **route_doc("version", VersionResponse, ()))
    async def version_endpoint():
        return {"version": _version()}

    async def health():
        out: dict[str, Any] = {
            "status": "ok",
            "model": server.model_name,
            "client_id": server.client_id,
            "running": server.engine.num_running,
            "waiting": server.engine.num_waiting,
            "routing_table_version": None,
        }
        if server.health_extra is not None:
            # off the event loop: the dispatcher's lock is held while a layer call waits on servers
            out.update(await asyncio.to_thread(server.health_extra))
        if out.get("uncovered_experts"):
            # some (layer, expert) has no live replica: requests needing it get 503, so tell a
            # readiness probe to route elsewhere until coverage returns
            out["status"] = "degraded"
            return JSONResponse(status_code=503, content=out)
        return out

    # GET and HEAD are two operations (one route for both gave them one operation id)
    health_answers = {503: {"model": HealthResponse, "description": "degraded"}}
    health_doc = route_doc("health", HealthResponse, ())
    health_doc["responses"].update(health_answers)
    app.get("/health", **health_doc)(health)
    head_doc = route_doc("health_head", None, ())
    head_doc["responses"].update({503: {"description": "degraded"}})
    app.head("/health", **head_doc)(health)

    metrics_doc = route_doc("metrics", None, ())
    metrics_doc["responses"][200]["content"] = {"text/plain": {"schema": {"type": "string"}}}

    @app.get("/metrics", **metrics_doc)
    async def metrics_endpoint():
        return Response(metrics.render_latest(), media_type=metrics.CONTENT_TYPE_LATEST)

    gen_errors = (400, 401, 404, 413, 415, 503)

    @app.post(
        "/v1/completions", **route_doc("create_completion", CompletionResponse, gen_errors, True)
    )
    async def completions(request: Request):
        # tokenizing a long prompt takes seconds: in a worker thread, so /health and the running
        # streams keep being served meanwhile
        prep = await asyncio.to_thread(server.prepare_completion, await _json_body(request))
        return await server.generate(request, prep)

    @app.post(
        "/v1/chat/completions",
        **route_doc("create_chat_completion", ChatCompletionResponse, gen_errors, True),
    )
    async def chat_completions(request: Request):
        prep = await asyncio.to_thread(server.prepare_chat, await _json_body(request))
        return await server.generate(request, prep)

    # encoded in the worker thread too: a 30 MB prompt's token list stalled the event loop
    tok_errors = (400, 401, 404, 413, 415)

    @app.post("/tokenize", **route_doc("tokenize", TokenizeResponse, tok_errors))
    async def tokenize(request: Request):
        body = await _json_body(request)

        def encode() -> bytes:  # the token list in runs: one json.dumps holds the GIL
            d = server.tokenize(body).model_dump()
            toks, run = d["tokens"], 1 << 16
            parts = (json_bytes(toks[i : i + run])[1:-1] for i in range(0, len(toks), run))
            return json_bytes_with_array(d, "tokens", parts)

        out = await asyncio.to_thread(encode)
        return Response(content=out, media_type="application/json")

    @app.post("/detokenize", **route_doc("detokenize", DetokenizeResponse, tok_errors))
    async def detokenize(request: Request):
        body = await _json_body(request)
        out = await asyncio.to_thread(lambda: json_bytes(server.detokenize(body).model_dump()))
        return Response(content=out, media_type="application/json")

    return app
