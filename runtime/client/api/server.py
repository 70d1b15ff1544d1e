"""The OpenAI-compatible API's state and generation: bodies in, engine requests, answers out.

:class:`OpenAIServer` holds what the handlers (:mod:`.app`) share: the engine, the request
preparation (:mod:`.prepare`), the logprob layout (:mod:`.logprobs`) and the running requests'
event queues. :meth:`OpenAIServer.generate` submits the ``n`` choices per prompt of a prepared
request (each its own engine request), then answers from their token events: a JSON body
(:mod:`.responses`) or an SSE stream (:mod:`.streaming`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from eaas.runtime import metrics
from eaas.runtime.client.api.beam import beam_search, finished_request
from eaas.runtime.client.api.bodies import DetokenizeResponse, TokenizeResponse
from eaas.runtime.client.api.logprobs import LogprobFormatter
from eaas.runtime.client.api.prepare import Prepared, RequestPreparer
from eaas.runtime.client.api.protocol import APIError
from eaas.runtime.client.api.responses import (
    Choice,
    Generation,
    ServerShuttingDown,
    build_response,
    encode_response,
    exc_error,
)
from eaas.runtime.client.api.streaming import (
    GONE,
    ClientGone,
    EventMailbox,
    stream_response,
    watch_disconnect,
)
from eaas.runtime.client.engine import Engine
from eaas.runtime.client.request import ErrorEvent, GenerationRequest

log = logging.getLogger("eaas.client.api")


def event_callback(
    box: EventMailbox, q: asyncio.Queue, idx: int, request: Callable[[], GenerationRequest | None]
) -> Callable[[object], None]:
    """The engine's callback for choice ``idx``: posts ``(idx, event)`` to ``q`` through ``box``.

    Once the event loop is closed (Ctrl-C during a stream: the loop ends while the engine thread
    still emits), there is nobody to answer: the choice's engine request (``request()``) is
    cancelled and the event dropped, instead of ``RuntimeError: Event loop is closed`` reaching
    the engine, which logged it with a traceback for every token left.
    """

    def on_event(ev) -> None:
        try:
            box.post(q, (idx, ev))
        except RuntimeError:
            if not box.loop.is_closed():
                raise
            req = request()
            if req is not None and not req.done:
                req.cancel()
            log.debug("choice %d: event after the event loop closed, dropped", idx)

    return on_event


#: Largest request body accepted (bytes); larger ones get 413 ``request_too_large``
#: (``attention-client --max-request-body``). Generous: a full 128k-token prompt is ~1 MiB.
DEFAULT_MAX_REQUEST_BODY = 32 * 2**20


class OpenAIServer:
    """State shared by the handlers.

    Args:
        engine: the running :class:`Engine`.
        tokenizer: the model's tokenizer.
        model_name: id served under ``/v1/models`` and accepted in ``model``.
        max_context: ``max_position_embeddings`` (prompt + completion tokens limit).
        vocab_size: valid token ids are ``[0, vocab_size)`` (the model's embedding rows).
        client_id: label of this client (metrics, /health).
        health_extra: callable returning extra /health fields (e.g. the dispatcher's view).
        max_request_body: largest request body in bytes (larger: 413 ``request_too_large``).
        api_keys: the keys ``Authorization: Bearer`` must carry on ``/v1/*``, ``/tokenize``,
            ``/detokenize`` (empty: no key needed; :mod:`.guard`).
        aliases: other model ids accepted in ``model`` and listed by ``/v1/models``.
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
        max_request_body: int = DEFAULT_MAX_REQUEST_BODY,
        api_keys: tuple[str, ...] = (),
        aliases: tuple[str, ...] = (),
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = int(max_context)
        self.vocab_size = int(vocab_size)
        self.client_id = str(client_id)
        self.health_extra = health_extra
        self.max_request_body = int(max_request_body)
        self.api_keys = tuple(api_keys)
        self.created = int(time.time())
        self.aliases = tuple(a for a in aliases if a != model_name)
        self.requests = RequestPreparer(
            tokenizer, model_name, self.max_context, self.vocab_size, self.aliases
        )
        self.logprobs = LogprobFormatter(tokenizer)
        self.shutting_down = False
        self._queues: set[asyncio.Queue] = set()  # event queues of the running requests
        self._mailbox: EventMailbox | None = None  # engine events -> the loop (per loop)

    def shut_down(self) -> int:
        """End every running request with 503 ``server_shutting_down`` and refuse new ones.

        Call on the event loop. Returns the number of requests ended.
        """
        self.shutting_down = True
        err = ErrorEvent(ServerShuttingDown("the attention client is shutting down"))
        for q in list(self._queues):
            q.put_nowait((0, err))
        return len(self._queues)

    # ---- request bodies (worker threads) ---------------------------------------------------
    def prepare_completion(self, body: dict) -> Prepared:
        """Validate a ``/v1/completions`` body. Raises: APIError (400 / 404)."""
        return self.requests.prepare_completion(body)

    def prepare_chat(self, body: dict) -> Prepared:
        """Validate a ``/v1/chat/completions`` body. Raises: APIError (400 / 404)."""
        return self.requests.prepare_chat(body)

    def tokenize(self, body: dict) -> TokenizeResponse:
        """``POST /tokenize``. Raises: APIError (400 / 404)."""
        return self.requests.tokenize(body)

    def detokenize(self, body: dict) -> DetokenizeResponse:
        """``POST /detokenize``. Raises: APIError (400 / 404)."""
        return self.requests.detokenize(body)

    # ---- generation (event loop) -----------------------------------------------------------
    async def generate(self, request: Request, prep: Prepared):
        """Run ``prep`` on the engine; a JSON response, an SSE stream, or an error response."""
        if self.shutting_down:
            raise APIError(
                503,
                "the attention client is shutting down; retry on another replica",
                "service_unavailable",
                None,
                "server_shutting_down",
            )
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._queues.add(q)
        try:
            resp = await self._generate(request, prep, loop, q)
        except BaseException:
            self._queues.discard(q)
            raise
        if not isinstance(resp, StreamingResponse):  # a stream drops q when it ends (sse_body)
            self._queues.discard(q)
        return resp

    def _submit(self, prep: Prepared, loop, q: asyncio.Queue) -> Generation:
        """Submit every choice of ``prep``; their events arrive on ``q`` as ``(index, event)``."""
        n = len(prep.params)
        choices: list[Choice] = []
        box = self._mailbox
        if box is None or box.loop is not loop:
            box = self._mailbox = EventMailbox(loop)
        for p in range(len(prep.prompts)):
            for i in range(n):
                idx = len(choices)
                params = prep.params[i]
                if prep.max_tokens is not None and prep.max_tokens[p] != params.max_tokens:
                    params = dataclasses.replace(params, max_tokens=prep.max_tokens[p])
                made: list[GenerationRequest] = []  # the request, once submit returns it

                def request_of(m: list[GenerationRequest] = made) -> GenerationRequest | None:
                    return m[0] if m else None

                on_event = event_callback(box, q, idx, request_of)
                req = self.engine.submit(prep.prompts[p], params, on_event)
                made.append(req)
                choices.append(Choice(index=idx, prompt=p, req=req))
        rid = ("chatcmpl-" if prep.chat else "cmpl-") + uuid.uuid4().hex[:24]
        return Generation(prep, choices, rid, int(time.time()), self.model_name)

    async def _beam_search(self, prep: Prepared) -> Response:
        """``use_beam_search``: ``n`` beams per prompt (:mod:`.beam`), answered at once."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        choices: list[Choice] = []
        for p, prompt in enumerate(prep.prompts):
            params = prep.params[0]
            if prep.max_tokens is not None:
                params = dataclasses.replace(params, max_tokens=prep.max_tokens[p])
            try:
                beams = await beam_search(
                    self.engine,
                    prompt,
                    len(prep.params),
                    params.max_tokens,
                    eos,
                    params.ignore_eos,
                    prep.length_penalty,
                    params.include_stop_str_in_output,
                )
            except Exception as exc:  # noqa: BLE001 -- the engine's error, as a request's
                return exc_error(exc).response()
            for b in beams:
                req = finished_request(self.tokenizer, prompt, b, params, eos)
                choices.append(
                    Choice(
                        len(choices), p, req, finish=req.finish_reason, stop_reason=b.stop_reason
                    )
                )
        rid = ("chatcmpl-" if prep.chat else "cmpl-") + uuid.uuid4().hex[:24]
        gen = Generation(prep, choices, rid, int(time.time()), self.model_name)
        metrics.REQUESTS.labels(client_id=self.client_id, status="200").inc()
        body = await asyncio.to_thread(lambda: encode_response(build_response(gen, self.logprobs)))
        return Response(content=body, media_type="application/json")

    async def _generate(self, request: Request, prep: Prepared, loop, q: asyncio.Queue):
        if prep.beam_search:
            return await self._beam_search(prep)
        gen = self._submit(prep, loop, q)
        if prep.stream:
            return await stream_response(
                request, gen, q, self.logprobs, self.client_id, lambda: self._queues.discard(q)
            )
        return await self._answer(request, gen, q)

    async def _answer(self, request: Request, gen: Generation, q: asyncio.Queue) -> Response:
        """Wait for every choice's last event, then answer the whole body at once."""
        label = self.client_id
        watcher = asyncio.create_task(watch_disconnect(request, gen.cancel_all, q))
        left = len(gen.choices)
        try:
            while left:
                idx, ev = await q.get()
                if ev is GONE:
                    raise ClientGone()
                ch = gen.choices[idx]
                if isinstance(ev, ErrorEvent):
                    gen.cancel_all()
                    err = exc_error(ev.error)
                    metrics.REQUESTS.labels(client_id=label, status=str(err.status)).inc()
                    return err.response()
                ch.events.append(ev)
                if ev.finish_reason is not None:
                    ch.finish, ch.stop_reason = ev.finish_reason, ev.stop_reason
                    left -= 1
        except BaseException as exc:
            gen.cancel_all()
            if isinstance(exc, (ClientGone, asyncio.CancelledError)):
                metrics.REQUESTS.labels(client_id=label, status="cancelled").inc()
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            raise  # anything else is a bug: the app's handler answers (and counts) a JSON 500
        finally:
            watcher.cancel()
        metrics.REQUESTS.labels(client_id=label, status="200").inc()
        # built and encoded in a worker thread (encode_response)
        body = await asyncio.to_thread(lambda: encode_response(build_response(gen, self.logprobs)))
        return Response(content=body, media_type="application/json")
