"""Streamed answers (Server-Sent Events) and the engine-to-event-loop hand-over.

The engine thread posts each choice's token events to the request's ``asyncio.Queue`` through
an :class:`EventMailbox` (one loop wake-up per burst of events). :func:`watch_disconnect` polls
the HTTP connection and cancels the generation when the client leaves. :func:`stream_response`
waits for the first event (an error before it is answered with its HTTP status), then streams
OpenAI's chunks (``data: {...}`` lines, ``data: [DONE]`` last) from :func:`sse_body`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from eaas.runtime import metrics
from eaas.runtime.client.api.bodies import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
    UsageInfo,
)
from eaas.runtime.client.api.logprobs import LogprobFormatter
from eaas.runtime.client.api.responses import Choice, Generation, exc_error, token_ids_of
from eaas.runtime.client.request import ErrorEvent, TokenEvent

log = logging.getLogger("eaas.client.api")

DISCONNECT_POLL_S = 0.1

#: queued by the disconnect watcher (a stream's only before its first token)
GONE = object()


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


class EventMailbox:
    """Hands the engine thread's events to the event loop, one loop wake-up per burst.

    The engine emits one event per token per sequence from its own thread. A
    ``loop.call_soon_threadsafe`` per event costs a self-pipe write (a syscall) in the engine
    thread and a wake-up of the loop thread (which then competes for the GIL) per token; with
    32 streams that is 32 of each per decode step. Here an event posted while a drain is already
    pending joins it, so one step's events for all streams cost about one wake-up. Each queue
    gets its events in the order they were posted.

    Args:
        loop: the event loop whose thread owns the queues.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []

    def post(self, q: asyncio.Queue, item: object) -> None:
        """From any thread: ``q.put_nowait(item)`` on the loop, soon.

        Raises:
            RuntimeError: the loop is closed (as ``call_soon_threadsafe``).
        """
        with self._lock:
            self._items.append((q, item))
            if len(self._items) > 1:
                return  # a drain is pending: it takes this one too
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: no drain will come, so none is pending
            with self._lock:
                self._items.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for q, item in items:
            q.put_nowait(item)


async def watch_disconnect(request: Request, cancel_all, q: asyncio.Queue) -> None:
    """Poll the connection every ``DISCONNECT_POLL_S`` (on its own clock: while tokens keep
    arriving the event queue never idles); when the client is gone, cancel every choice
    and queue :data:`GONE`."""
    try:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
    except Exception:  # noqa: BLE001  (receive channel unusable: stop watching)
        log.debug("disconnect watcher stopped", exc_info=True)
        return
    cancel_all()
    q.put_nowait((-1, GONE))


async def stream_response(
    request: Request,
    gen: Generation,
    q: asyncio.Queue,
    fmt: LogprobFormatter,
    client_id: str,
    on_end: Callable[[], None],
) -> Response:
    """The answer of a streamed generation whose events arrive on ``q``.

    An error before the first token (no live replica, a bad prompt found by the engine) is
    answered with its HTTP status, not as a 200 stream that carries the error; a client that
    leaves before then (queued behind ``--max-num-seqs``) is cancelled at once (499). Else an
    SSE stream (:func:`sse_body`), which calls ``on_end`` when it ends.
    """
    watcher = asyncio.create_task(watch_disconnect(request, gen.cancel_all, q))
    try:
        head = await q.get()
    finally:
        watcher.cancel()
    if head[1] is GONE:
        metrics.REQUESTS.labels(client_id=client_id, status="cancelled").inc()
        return Response(status_code=499)
    if isinstance(head[1], ErrorEvent):
        gen.cancel_all()
        err = exc_error(head[1].error)
        metrics.REQUESTS.labels(client_id=client_id, status=str(err.status)).inc()
        return err.response()
    return StreamingResponse(
        sse_body(gen, q, fmt, client_id, on_end, head),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _dump(gen: Generation, chunk: ChatCompletionChunk | CompletionChunk, ch: Choice) -> dict:
    """``chunk`` as a dict with the ``usage`` that ``stream_options`` asks for."""
    prep = gen.prep
    d = chunk.model_dump()
    for c in d["choices"]:  # vLLM's prompt keys ride on a choice's first chunk only
        for key in ("prompt_token_ids", "prompt_logprobs"):
            if key in c and c[key] is None:
                del c[key]
    if prep.continuous_usage:
        # as vLLM: this choice's prompt and the tokens it has streamed so far
        pt, ct = len(prep.prompts[ch.prompt]), len(ch.events)
        d["usage"] = UsageInfo(
            prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct
        ).model_dump()
    elif prep.include_usage:
        d["usage"] = None
    else:
        d.pop("usage")
    return d


def _event_chunk(
    gen: Generation,
    fmt: LogprobFormatter,
    ch: Choice,
    ev: TokenEvent,
    first: bool,
    offsets: dict[int, int],
) -> ChatCompletionChunk | CompletionChunk:
    """The chunk of one token event of ``ch`` (``first``: the choice's first token, which
    carries the echoed prompt; ``offsets``: per choice the text offset of its next logprob)."""
    prep = gen.prep
    if prep.chat:
        return gen.chunk(
            [
                ChatChunkChoice(
                    index=ch.index,
                    delta=DeltaMessage(content=ev.text),
                    logprobs=fmt.chat_logprobs([ev], prep.tokens_as_ids)
                    if prep.logprobs is not None
                    else None,
                    finish_reason=ev.finish_reason,
                    stop_reason=ev.stop_reason,
                    token_ids=token_ids_of(prep, [ev.token_id]),
                )
            ]
        )
    text = ev.text
    if first:
        text = prep.echo_texts[ch.prompt] + text
    lp = None
    if prep.logprobs is not None:
        lp, offsets[ch.index] = fmt.choice_logprobs(prep, ch.prompt, [ev], offsets[ch.index], first)
    return gen.chunk(
        [
            CompletionChoice(
                index=ch.index,
                text=text,
                logprobs=lp,
                finish_reason=ev.finish_reason,
                stop_reason=ev.stop_reason,
                token_ids=token_ids_of(prep, [ev.token_id]),
                prompt_token_ids=list(prep.prompts[ch.prompt])
                if first and prep.return_token_ids
                else None,
            )
        ]
    )


async def sse_body(
    gen: Generation,
    q: asyncio.Queue,
    fmt: LogprobFormatter,
    client_id: str,
    on_end: Callable[[], None],
    head: tuple[int, Any] | None = None,
) -> AsyncIterator[str]:
    """The SSE body; ``head`` is the first ``(choice index, event)``, already taken off ``q``.

    Counts the request in ``eaas_requests_total`` (200, the error's status, or cancelled) and
    calls ``on_end`` when the stream ends, however it ends.
    """
    prep, choices = gen.prep, gen.choices
    status = "cancelled"
    offsets = {ch.index: len(prep.echo_texts[ch.prompt]) for ch in choices}
    try:
        if prep.chat:
            for ch in choices:
                role = ChatChunkChoice(
                    index=ch.index,
                    delta=DeltaMessage(role=prep.role, content=""),
                    token_ids=token_ids_of(prep, []),  # no token yet
                )
                d = _dump(gen, gen.chunk([role]), ch)
                if prep.return_token_ids and ch.index == 0:  # vLLM: on the first chunk only
                    d["prompt_token_ids"] = list(prep.prompts[0])
                yield _data(d)
            echo = prep.echo_texts[0]
            for ch in choices if echo else ():  # vLLM's chat echo: the last message's text
                part = ChatChunkChoice(
                    index=ch.index,
                    delta=DeltaMessage(content=echo),
                    token_ids=token_ids_of(prep, []),
                )
                yield _data(_dump(gen, gen.chunk([part]), ch))
        left = len(choices)
        first = {ch.index for ch in choices}
        while left:
            if head is not None:
                (idx, ev), head = head, None
            else:
                idx, ev = await q.get()
            if ev is GONE:  # the pre-head watcher saw the client leave as the head came
                return
            ch = choices[idx]
            if isinstance(ev, ErrorEvent):
                gen.cancel_all()
                err = exc_error(ev.error)
                status = str(err.status)
                body = err.body()
                body["error"]["param"] = None
                yield _data(body)
                yield "data: [DONE]\n\n"
                return
            ch.events.append(ev)
            if ev.finish_reason is not None:
                ch.finish, ch.stop_reason = ev.finish_reason, ev.stop_reason
                left -= 1
            chunk = _event_chunk(gen, fmt, ch, ev, ch.index in first, offsets)
            first.discard(ch.index)
            yield _data(_dump(gen, chunk, ch))
        if prep.include_usage:
            d = gen.chunk([]).model_dump()
            d["usage"] = gen.usage().model_dump()
            yield _data(d)
        yield "data: [DONE]\n\n"
        status = "200"
    except Exception as exc:  # a bug while building a chunk: end the stream with an error
        log.exception("stream %s failed", gen.id)
        status = "500"
        yield _data(exc_error(exc).body())
        yield "data: [DONE]\n\n"
    finally:
        on_end()
        gen.cancel_all()
        metrics.REQUESTS.labels(client_id=client_id, status=status).inc()
