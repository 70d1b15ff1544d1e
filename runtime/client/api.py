"""OpenAI-compatible HTTP API of one attention client (FastAPI).

Endpoints:

* ``POST /v1/completions`` -- ``prompt`` is a string, a list of token ids, or a list holding one
  string; ``max_tokens`` (default 16), ``temperature`` (default 1.0), ``top_p``, ``seed``,
  ``stop``, ``stream``, ``stream_options.include_usage``, ``n`` (only 1), ``ignore_eos``
  (vLLM-style extension).
* ``POST /v1/chat/completions`` -- ``messages`` rendered with the tokenizer's chat template;
  ``max_tokens`` / ``max_completion_tokens`` (default: the rest of the context).
* ``stream: true`` answers Server-Sent Events in OpenAI's chunk format ending with
  ``data: [DONE]``. A client that disconnects cancels its sequence (it leaves the decode batch at
  the next engine step); non-streaming requests poll for the disconnect every
  ``DISCONNECT_POLL_S`` while decoding.
* ``GET /v1/models``, ``GET /health`` (JSON: model, client id, routing table version in use =
  acknowledgement, running/waiting sequences, per-expert-server state, ``uncovered_experts``;
  503 with ``status: "degraded"`` while some (layer, expert) has no live replica, so readiness
  probes route elsewhere), ``GET /metrics`` (Prometheus; merged over all processes under
  ``eaas serve``).

Non-standard additions: every choice carries ``token_ids`` (the generated token ids; in streamed
chunks the ids of that chunk), so exact-token comparisons need no re-tokenization.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 ``invalid_request_error`` for malformed JSON, wrong types, empty prompt/messages, missing or
null ``content`` of a non-assistant message, non-finite ``temperature`` / ``top_p``, ``seed``
outside the 64-bit range, ``max_tokens <= 0``, prompt + max_tokens beyond the context window, unknown model (code
``model_not_found``); FastAPI's 422 validation errors are mapped to 400 as well. 503
``service_unavailable`` when an expert has no live replica (retryable); 500 otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eaas.runtime import metrics
from eaas.runtime.client.engine import Engine, ErrorEvent, SamplingParams

log = logging.getLogger("eaas.client.api")

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# torch.Generator.manual_seed takes signed or unsigned 64-bit seeds
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type_, "param": param, "code": code}},
    )


def _is_retryable(exc: BaseException) -> bool:
    from eaas.runtime.client.dispatch import NoLiveReplicaError

    return isinstance(exc, NoLiveReplicaError)


def _exc_error(exc: BaseException) -> APIError:
    if _is_retryable(exc):
        return APIError(503, f"{exc}; retry later", "service_unavailable", None, "no_live_replica")
    return APIError(
        500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", None, None
    )


# ---- request validation (explicit, so every message names the offending field) ------------
def _int(body: dict, key: str, default: int | None, minimum: int | None = None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(
            400,
            f"'{key}' must be an integer, got {type(v).__name__} {v!r}",
            param=key,
            code="invalid_type",
        )
    if minimum is not None and v < minimum:
        raise APIError(
            400, f"'{key}' must be >= {minimum}, got {v}", param=key, code="invalid_value"
        )
    return v


def _num(
    body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError(
            400,
            f"'{key}' must be a number, got {type(v).__name__} {v!r}",
            param=key,
            code="invalid_type",
        )
    if not math.isfinite(v):  # Python's json accepts NaN / Infinity / -Infinity
        raise APIError(
            400, f"'{key}' must be a finite number, got {v}", param=key, code="invalid_value"
        )
    if v > hi or v < lo or (lo_open and v <= lo):
        raise APIError(
            400,
            f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}",
            param=key,
            code="invalid_value",
        )
    return float(v)


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(
            400,
            f"'{key}' must be a boolean, got {type(v).__name__} {v!r}",
            param=key,
            code="invalid_type",
        )
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise APIError(
            400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type"
        )
    if len(v) > 4:
        raise APIError(
            400, "'stop' accepts at most 4 sequences", param="stop", code="invalid_value"
        )
    return [s for s in v if s]


class _ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


_GONE = object()  # queued by the disconnect watcher of a non-streaming request
DISCONNECT_POLL_S = 0.1


@dataclass
class _Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


class OpenAIServer:
    """State shared by the handlers.

    Args:
        engine: the running :class:`Engine`.
        tokenizer: the model's tokenizer.
        model_name: id served under ``/v1/models`` and accepted in ``model``.
        max_context: ``max_position_embeddings`` (prompt + completion tokens limit).
        vocab_size: valid token ids are ``[0, vocab_size)``.
        client_id: label of this client (metrics, /health).
        health_extra: callable returning extra /health fields (e.g. the dispatcher's view).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        model_name: str,
        max_context: int,
        vocab_size: int,
        client_id: str,
        health_extra=None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = int(max_context)
        self.vocab_size = int(vocab_size)
        self.client_id = str(client_id)
        self.health_extra = health_extra
        self.created = int(time.time())

    # ---- parsing ----------------------------------------------------------------------
    def _check_model(self, body: dict) -> None:
        m = body.get("model")
        if m is None:
            return
        if not isinstance(m, str):
            raise APIError(
                400,
                f"'model' must be a string, got {type(m).__name__}",
                param="model",
                code="invalid_type",
            )
        if m != self.model_name:
            raise APIError(
                400,
                f"The model '{m}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def _common(
        self,
        body: dict,
        prompt_ids: list[int],
        max_tokens_key: str,
        default_max: int | None,
        prompt_param: str,
    ) -> _Prepared:
        n = _int(body, "n", 1, 1)
        if n != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
        max_tokens = _int(body, max_tokens_key, None)
        if max_tokens is None and max_tokens_key == "max_completion_tokens":
            max_tokens = _int(body, "max_tokens", None)
            max_tokens_key = "max_tokens"
        if max_tokens is not None and max_tokens <= 0:
            raise APIError(
                400,
                f"'{max_tokens_key}' must be >= 1, got {max_tokens}",
                param=max_tokens_key,
                code="invalid_value",
            )
        room = self.max_context - len(prompt_ids)
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt has {len(prompt_ids)} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        if len(prompt_ids) + max_tokens > self.max_context:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param=max_tokens_key,
                code="context_length_exceeded",
            )
        seed = _int(body, "seed", None)
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
            raise APIError(
                400,
                f"'seed' must be in [{SEED_MIN}, {SEED_MAX}] (64 bit), got {seed}",
                param="seed",
                code="invalid_value",
            )
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise APIError(
                400,
                "'stream_options' must be an object",
                param="stream_options",
                code="invalid_type",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            seed=seed,
            stop=_stop(body),
            ignore_eos=_bool(body, "ignore_eos", False),
        )
        return _Prepared(
            prompt_ids,
            params,
            _bool(body, "stream", False),
            bool((so or {}).get("include_usage", False)),
        )

    def prepare_completion(self, body: dict) -> _Prepared:
        self._check_model(body)
        if "prompt" not in body or body["prompt"] is None:
            raise APIError(
                400, "'prompt' is required", param="prompt", code="missing_required_parameter"
            )
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(
                    400, "'prompt' must not be empty", param="prompt", code="invalid_value"
                )
            ids = self.tokenizer(p)["input_ids"]
        elif isinstance(p, list):
            if not p:
                raise APIError(
                    400, "'prompt' must not be empty", param="prompt", code="invalid_value"
                )
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise APIError(
                    400,
                    "'prompt' must be a string, a list of token ids, or a list with one string",
                    param="prompt",
                    code="invalid_type",
                )
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"'prompt' has token ids outside [0, {self.vocab_size}): {bad[:5]}",
                    param="prompt",
                    code="invalid_value",
                )
            ids = list(p)
        else:
            raise APIError(
                400,
                f"'prompt' must be a string or a list of token ids, got {type(p).__name__}",
                param="prompt",
                code="invalid_type",
            )
        if not ids:
            raise APIError(
                400, "'prompt' tokenizes to zero tokens", param="prompt", code="invalid_value"
            )
        return self._common(body, ids, "max_tokens", 16, "prompt")

    def prepare_chat(self, body: dict) -> _Prepared:
        self._check_model(body)
        msgs = body.get("messages")
        if msgs is None:
            raise APIError(
                400, "'messages' is required", param="messages", code="missing_required_parameter"
            )
        if not isinstance(msgs, list):
            raise APIError(
                400,
                f"'messages' must be a list, got {type(msgs).__name__}",
                param="messages",
                code="invalid_type",
            )
        if not msgs:
            raise APIError(
                400, "'messages' must not be empty", param="messages", code="invalid_value"
            )
        norm = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise APIError(
                    400,
                    f"'messages[{i}]' must be an object",
                    param=f"messages[{i}]",
                    code="invalid_type",
                )
            role, content = m.get("role"), m.get("content")
            if role not in CHAT_ROLES:
                raise APIError(
                    400,
                    f"'messages[{i}].role' must be one of {list(CHAT_ROLES)}, got {role!r}",
                    param=f"messages[{i}].role",
                    code="invalid_value",
                )
            if isinstance(content, list):
                parts = []
                for part in content:
                    if (
                        not isinstance(part, dict)
                        or part.get("type") != "text"
                        or not isinstance(part.get("text"), str)
                    ):
                        raise APIError(
                            400,
                            f"'messages[{i}].content' parts must be {{'type': 'text', 'text': str}}",
                            param=f"messages[{i}].content",
                            code="invalid_type",
                        )
                    parts.append(part["text"])
                content = "".join(parts)
            elif content is None:
                # OpenAI allows a null/missing content only on assistant messages (tool calls)
                if role != "assistant":
                    missing = "missing" if "content" not in m else "null"
                    raise APIError(
                        400,
                        f"'messages[{i}].content' is {missing}; {role} messages need a string or a list of text parts",
                        param=f"messages[{i}].content",
                        code="invalid_value" if missing == "null" else "missing_required_parameter",
                    )
                content = ""
            elif not isinstance(content, str):
                raise APIError(
                    400,
                    f"'messages[{i}].content' must be a string or a list of text parts",
                    param=f"messages[{i}].content",
                    code="invalid_type",
                )
            norm.append({"role": role, "content": content})
        ids = self.render_chat(norm)
        return self._common(body, ids, "max_completion_tokens", None, "messages")

    def render_chat(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:  # plain fallback
            text = (
                "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
            )
            if getattr(tok, "bos_token", None):
                text = tok.bos_token + text
        return tok(text, add_special_tokens=False)["input_ids"]


def create_app(server: OpenAIServer) -> FastAPI:
    """Build the FastAPI app around ``server`` (see the module docstring for the endpoints)."""
    app = FastAPI(title="EaaS attention client", docs_url=None, redoc_url=None)
    app.state.eaas = server

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return error_response(
            400, f"invalid request: {first.get('msg', str(exc))}", param=loc, code="invalid_value"
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        code = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), type_, None, code)

    async def _json_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(
                400, f"request body is not valid JSON: {exc}", code="invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        return body

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "eaas",
                    "max_model_len": server.max_context,
                }
            ],
        }

    @app.get("/health")
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

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render_latest(), media_type=metrics.CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        prep = server.prepare_completion(body)
        return await _run(request, prep, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json_body(request)
        prep = server.prepare_chat(body)
        return await _run(request, prep, chat=True)

    async def _run(request: Request, prep: _Prepared, chat: bool):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_event(ev) -> None:
            loop.call_soon_threadsafe(q.put_nowait, ev)

        req = server.engine.submit(prep.prompt_ids, prep.params, on_event)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        label = server.client_id

        async def watch_disconnect() -> None:
            # Polled on its own clock: while tokens keep arriving the event queue never idles,
            # so polling only when it is empty would never notice the client leaving.
            try:
                while not await request.is_disconnected():
                    await asyncio.sleep(DISCONNECT_POLL_S)
            except Exception:  # noqa: BLE001  (receive channel unusable: stop watching)
                log.debug("disconnect watcher stopped", exc_info=True)
                return
            req.cancel()
            q.put_nowait(_GONE)

        async def next_event():
            ev = await q.get()
            if ev is _GONE:
                raise _ClientGone()
            return ev

        # Streams must not read the ASGI receive channel here: StreamingResponse listens on it for
        # the disconnect (reading it here may swallow uvicorn's state). Non-streaming requests
        # poll it until the answer is complete to notice a client that went away.
        watcher = None if prep.stream else asyncio.create_task(watch_disconnect())
        try:
            first = await next_event()
        except BaseException as exc:
            if watcher is not None:
                watcher.cancel()
            req.cancel()
            metrics.REQUESTS.labels(client_id=label, status="cancelled").inc()
            if isinstance(exc, _ClientGone):
                return Response(status_code=499)
            raise
        if isinstance(first, ErrorEvent):
            if watcher is not None:
                watcher.cancel()
            err = _exc_error(first.error)
            metrics.REQUESTS.labels(client_id=label, status=str(err.status)).inc()
            return err.response()

        usage = lambda: {  # noqa: E731
            "prompt_tokens": len(prep.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "total_tokens": len(prep.prompt_ids) + len(req.output_ids),
        }

        if not prep.stream:
            ev = first
            try:
                while ev.finish_reason is None:
                    ev = await next_event()
                    if isinstance(ev, ErrorEvent):
                        err = _exc_error(ev.error)
                        metrics.REQUESTS.labels(client_id=label, status=str(err.status)).inc()
                        return err.response()
            except BaseException as exc:
                req.cancel()
                metrics.REQUESTS.labels(client_id=label, status="cancelled").inc()
                if isinstance(exc, _ClientGone):
                    return Response(status_code=499)
                raise
            finally:
                watcher.cancel()
            metrics.REQUESTS.labels(client_id=label, status="200").inc()
            if chat:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": req.text},
                    "logprobs": None,
                    "finish_reason": req.finish_reason,
                    "token_ids": list(req.output_ids),
                }
            else:
                choice = {
                    "index": 0,
                    "text": req.text,
                    "logprobs": None,
                    "finish_reason": req.finish_reason,
                    "token_ids": list(req.output_ids),
                }
            return {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": server.model_name,
                "choices": [choice],
                "usage": usage(),
            }

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(
            text: str | None, token_ids: list[int], finish: str | None, role: bool = False
        ) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                    "token_ids": token_ids,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text or "",
                    "logprobs": None,
                    "finish_reason": finish,
                    "token_ids": token_ids,
                }
            payload = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": server.model_name,
                "choices": [choice],
            }
            if prep.include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

        async def sse():
            status = "cancelled"
            try:
                if chat:
                    yield chunk("", [], None, role=True)
                ev = first
                while True:
                    if isinstance(ev, ErrorEvent):
                        err = _exc_error(ev.error)
                        status = str(err.status)
                        yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.type, 'param': None, 'code': err.code}})}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    yield chunk(ev.text, [ev.token_id], ev.finish_reason)
                    if ev.finish_reason is not None:
                        break
                    ev = await next_event()
                if prep.include_usage:
                    payload = {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": server.model_name,
                        "choices": [],
                        "usage": usage(),
                    }
                    yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
                yield "data: [DONE]\n\n"
                status = "200"
            finally:
                if not req.done:
                    req.cancel()
                metrics.REQUESTS.labels(client_id=label, status=status).inc()

        return StreamingResponse(
            sse(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app
