"""Answers of the OpenAI-compatible API: errors, the choices of a generation, non-streamed bodies.

A generation (:class:`Generation`) is one API request on the engine: ``n`` choices per prompt
(:class:`Choice`, each its own engine request) and what every body or chunk of its answer
shares (id, creation time, model). :func:`build_response` makes the body of a finished
generation and :func:`encode_response` encodes it in parts (:func:`json_bytes_with_array`), so
the event loop keeps running while a large answer is encoded; :func:`exc_error` maps an engine
failure to its API error. Streamed answers are in :mod:`.streaming`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from eaas.runtime.client.api.bodies import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    FunctionCallOut,
    PromptLogprobs,
    ToolCallOut,
    UsageInfo,
)
from eaas.runtime.client.api.logprobs import LogprobFormatter
from eaas.runtime.client.api.prepare import Prepared
from eaas.runtime.client.api.protocol import APIError
from eaas.runtime.client.dispatch import NoLiveReplicaError
from eaas.runtime.client.request import GenerationRequest, TokenEvent


class ServerShuttingDown(Exception):
    """This attention client is stopping (SIGTERM/SIGINT): its running requests end with it."""


def exc_error(exc: BaseException) -> APIError:
    """The API error for an engine failure: 503 (retryable) when no replica is live or the client
    is shutting down (``server_shutting_down``), else 500."""
    if isinstance(exc, ServerShuttingDown):
        return APIError(
            503,
            f"{exc}; retry on another replica",
            "service_unavailable",
            None,
            "server_shutting_down",
        )
    if isinstance(exc, NoLiveReplicaError):
        return APIError(503, f"{exc}; retry later", "service_unavailable", None, "no_live_replica")
    return APIError(
        500,
        f"internal error: {type(exc).__name__}: {exc}",
        "internal_error",
        None,
        "internal_error",
    )


def json_bytes(content: Any) -> bytes:
    """``content`` as Starlette's ``JSONResponse`` encodes it (UTF-8, compact, no NaN)."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


_ARRAY_MARK = "\x00eaas-array\x00"  # JSON-encoded as "\u0000eaas-array\u0000": no real value


def json_bytes_with_array(head: dict, key: str, parts: Iterable[bytes]) -> bytes:
    """``head`` encoded as :func:`json_bytes`, with ``head[key]`` the JSON array whose elements
    are ``parts`` (each already encoded; a part may be several elements joined by commas).

    Encoding a large array in parts lets other threads (the event loop) run between them: one
    ``json.dumps`` call holds the GIL until it returns.
    """
    enc = json_bytes({**head, key: _ARRAY_MARK})
    mark = json_bytes(_ARRAY_MARK)
    i = enc.index(mark)
    return b"".join((enc[:i], b"[", b",".join(parts), b"]", enc[i + len(mark) :]))


@dataclass
class Choice:
    """One choice of a generation: its engine request and the events it delivered.

    Attributes:
        index: the choice's ``index`` in the answer (prompt-major: prompt ``p``, choice ``i``
            of ``n`` is ``p * n + i``).
        prompt: index of its prompt in :attr:`Prepared.prompts`.
        req: its engine request.
        events: the token events received so far, in order.
        finish, stop_reason: from its last event, once finished.
    """

    index: int
    prompt: int
    req: GenerationRequest
    events: list[TokenEvent] = field(default_factory=list)
    finish: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Generation:
    """One API request on the engine: its choices and what its answer's bodies share.

    Attributes:
        prep: the validated request.
        choices: every choice, indexed by :attr:`Choice.index`.
        id: ``chatcmpl-...`` or ``cmpl-...`` (24 hex digits).
        created: Unix time in seconds.
        model: the served model's name.
    """

    prep: Prepared
    choices: list[Choice]
    id: str
    created: int
    model: str

    def cancel_all(self) -> None:
        """Cancel every choice that has not finished (the client left, or one choice failed)."""
        for ch in self.choices:
            if not ch.req.done:
                ch.req.cancel()

    def usage(self) -> UsageInfo:
        """Tokens of every prompt and of every choice's output so far."""
        pt = sum(len(ids) for ids in self.prep.prompts)
        ct = sum(len(ch.req.output_ids) for ch in self.choices)
        return UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)

    def chunk(self, choices: list) -> ChatCompletionChunk | CompletionChunk:
        """A streamed chunk of this generation holding ``choices`` (chat or text chunk)."""
        cls = ChatCompletionChunk if self.prep.chat else CompletionChunk
        return cls(id=self.id, created=self.created, model=self.model, choices=choices)


def build_response(
    gen: Generation, fmt: LogprobFormatter
) -> ChatCompletionResponse | CompletionResponse:
    """The body of a finished generation (every choice has its final event)."""
    choices = [_final_choice(gen, fmt, ch) for ch in gen.choices]
    if gen.prep.chat:
        first = gen.choices[0]
        return ChatCompletionResponse(
            id=gen.id,
            created=gen.created,
            model=gen.model,
            choices=choices,
            usage=gen.usage(),
            prompt_logprobs=prompt_logprobs_of(gen, fmt, first),
            prompt_token_ids=list(gen.prep.prompts[0]) if gen.prep.return_token_ids else None,
        )
    return CompletionResponse(
        id=gen.id, created=gen.created, model=gen.model, choices=choices, usage=gen.usage()
    )


def prompt_logprobs_of(gen: Generation, fmt: LogprobFormatter, ch: Choice) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of ``ch``'s prompt (from its first event), or ``None`` when
    the request did not ask for them."""
    k = gen.prep.prompt_logprobs
    if k is None:
        return None
    rows = ch.events[0].prompt_logprobs if ch.events else None
    return fmt.prompt_logprobs(gen.prep.prompts[ch.prompt], rows, k)


def tool_calls_of(tool_call: str, text: str) -> list[ToolCallOut]:
    """The tool calls of an answer guided by a tool call's schema (vLLM): ``tool_call`` a
    function's name (``text`` is its arguments) or ``"required"`` (``text`` is a JSON array of
    ``{"name", "parameters"}``); ``[]`` when the text does not parse (cut by ``max_tokens``)."""
    if tool_call != "required":
        return [
            ToolCallOut(id=_call_id(), function=FunctionCallOut(name=tool_call, arguments=text))
        ]
    try:
        calls = json.loads(text)
        return [
            ToolCallOut(
                id=_call_id(),
                function=FunctionCallOut(
                    name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False)
                ),
            )
            for c in calls
        ]
    except (ValueError, TypeError, KeyError):
        return []


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def token_ids_of(prep: Prepared, ids: list[int]) -> list[int] | None:
    """A choice's ``token_ids``: ``ids`` with ``return_token_ids: true``, else ``None`` (as
    vLLM: only when asked)."""
    return ids if prep.return_token_ids else None


def _final_choice(gen: Generation, fmt: LogprobFormatter, ch: Choice) -> Any:
    """``ch`` in a non-streamed body: a ``ChatChoice`` or a ``CompletionChoice``."""
    prep = gen.prep
    end: dict[str, Any] = {
        "finish_reason": ch.finish,
        "stop_reason": ch.stop_reason,
        "token_ids": token_ids_of(prep, list(ch.req.output_ids)),
    }
    echo = prep.echo_texts[ch.prompt]
    if prep.chat:
        lp = None if prep.logprobs is None else fmt.chat_logprobs(ch.events, prep.tokens_as_ids)
        msg = ChatMessageOut(role=prep.role, content=echo + ch.req.text)
        if prep.tool_call is not None:
            msg.tool_calls = tool_calls_of(prep.tool_call, ch.req.text)
            if msg.tool_calls:
                msg.content = ""
                if prep.tool_call == "required" and ch.finish == "stop":
                    end["finish_reason"] = "tool_calls"  # OpenAI: "stop" for a named one
        return ChatChoice(index=ch.index, message=msg, logprobs=lp, **end)
    clp = None
    if prep.logprobs is not None:
        clp = fmt.choice_logprobs(prep, ch.prompt, ch.events, len(echo), True)[0]
    return CompletionChoice(
        index=ch.index,
        text=echo + ch.req.text,
        logprobs=clp,
        prompt_logprobs=prompt_logprobs_of(gen, fmt, ch),
        prompt_token_ids=list(prep.prompts[ch.prompt]) if prep.return_token_ids else None,
        **end,
    )


def encode_response(resp: ChatCompletionResponse | CompletionResponse) -> bytes:
    """``resp`` as JSON, one choice per encoder call (run it in a worker thread: a response of
    n=128 choices with 20 logprobs per token is tens of MB, and encoded on the event loop, or
    in one call, which holds the GIL throughout, it stalled every stream and /health)."""
    rest = resp.model_dump(exclude={"choices"})
    head = {k: rest.get(k) for k in type(resp).model_fields}  # OpenAI's key order
    parts = (json_bytes(c.model_dump()) for c in resp.choices)
    return json_bytes_with_array(head, "choices", parts)
