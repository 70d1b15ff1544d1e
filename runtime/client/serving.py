"""Serving logic of the OpenAI-compatible API: requests in, engine requests, responses out.

:class:`OpenAIServer` turns a validated request body (:mod:`.protocol`) into engine requests
(``n`` choices per prompt, each its own engine request; a seeded request's choice ``i`` uses seed
``seed + i``), and the engine's token events into OpenAI responses or Server-Sent Event chunks.
HTTP routing lives in :mod:`.api`; sampling in :mod:`.sampling`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.meta
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError

from eaas.runtime import metrics
from eaas.runtime.client.engine import Engine, ErrorEvent, GenerationRequest, TokenEvent
from eaas.runtime.client.protocol import (
    MAX_CHOICES,
    SEED_MAX,
    SEED_MIN,
    UNSUPPORTED,
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    _SamplingFields,
    bad,
    check_unsupported,
    parse,
)
from eaas.runtime.client.sampling import SAMPLING_EPS, SamplingParams

log = logging.getLogger("eaas.client.api")

DISCONNECT_POLL_S = 0.1

#: Largest request body accepted (bytes); larger ones get 413 ``request_too_large``
#: (``attention-client --max-request-body``). Generous: a full 128k-token prompt is ~1 MiB.
DEFAULT_MAX_REQUEST_BODY = 32 * 2**20


class _ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


_GONE = object()  # queued by the disconnect watcher (a stream's only before its first token)


class ServerShuttingDown(Exception):
    """This attention client is stopping (SIGTERM/SIGINT): its running requests end with it."""


def exc_error(exc: BaseException) -> APIError:
    """The API error for an engine failure: 503 (retryable) when no replica is live or the client
    is shutting down (``server_shutting_down``), else 500."""
    from eaas.runtime.client.dispatch import NoLiveReplicaError

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


@dataclass
class Prepared:
    """A validated request, ready for the engine.

    Attributes:
        prompts: token ids per prompt (one for chat).
        echo_texts: per prompt, the text prepended to each choice (``echo``), or ``""``.
        params: sampling parameters of choice ``i`` of each prompt (``n`` entries).
        stream, include_usage, continuous_usage: the streaming options.
        chat: chat completion (else text completion).
        logprobs: ``None`` or the number of top logprobs per token.
        tokens_as_ids: logprobs name tokens ``"token_id:<id>"`` (``return_tokens_as_token_ids``).
    """

    prompts: list[list[int]]
    echo_texts: list[str]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    chat: bool
    logprobs: int | None
    tokens_as_ids: bool = False


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


@dataclass
class _Choice:
    index: int
    prompt: int
    req: GenerationRequest
    events: list[TokenEvent] = field(default_factory=list)
    finish: str | None = None
    stop_reason: str | int | None = None


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


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str] | None:
    """Names a Jinja chat template reads from its context (``None``: it does not parse here, so
    no key can be checked). Cached: a server renders with one template."""
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None


def _temperature(value: float | None) -> float:
    """The request's temperature for :class:`SamplingParams`: 1 when not given (OpenAI's
    default), 0 (greedy) below :data:`SAMPLING_EPS` (vLLM)."""
    if value is None:
        return 1.0
    return 0.0 if value < SAMPLING_EPS else float(value)


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
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = int(max_context)
        self.vocab_size = int(vocab_size)
        self.client_id = str(client_id)
        self.health_extra = health_extra
        self.max_request_body = int(max_request_body)
        self.created = int(time.time())
        self._token_strs: dict[int, str] = {}
        self._max_token_chars: int | None = None  # longest vocabulary entry (check_text_length)
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

    # ---- validation -------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """Raises: APIError 404 ``model_not_found`` for a model this server does not serve."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_text_length(self, chars: int, param: str) -> None:
        """400 ``context_length_exceeded`` before tokenizing a text that cannot fit: no token is
        longer than the vocabulary's longest entry, so ``chars`` characters are at least ``chars /
        longest`` tokens (a factor 4 of slack for normalizers that merge characters). A 30 MB
        prompt took ~20 s and ~4 GB to tokenize only to be refused.

        Raises:
            APIError: 400 naming ``param``.
        """
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab()
            self._max_token_chars = max((len(t) for t in vocab), default=1) or 1
        limit = 4 * self.max_context * self._max_token_chars
        if chars > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; '{param}' has "
                f"{chars} characters, more than any text of that many tokens (at most {limit})",
                param=param,
                code="context_length_exceeded",
            )

    def check_ids(self, ids: list[int], param: str) -> None:
        """Raises: APIError 400 when an id is outside ``[0, vocab_size)``."""
        bad_ids = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise bad(
                f"'{param}' has token ids outside the model's vocabulary [0, {self.vocab_size}): "
                f"{bad_ids[:5]}",
                param,
            )

    def _params(
        self, req: _SamplingFields, n_prompt: int, max_tokens: int | None, key: str, param: str
    ) -> tuple[list[SamplingParams], int]:
        room = self.max_context - n_prompt
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt "
                f"has {n_prompt} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room
        if n_prompt + max_tokens > self.max_context:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, you "
                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} "
                "for the completion). Please reduce the prompt or max_tokens.",
                param=key,
                code="context_length_exceeded",
            )
        if req.min_tokens > max_tokens:
            raise bad(
                f"'min_tokens' ({req.min_tokens}) must be <= {key} ({max_tokens})", "min_tokens"
            )
        bias: dict[int, float] = {}
        for k, v in (req.logit_bias or {}).items():
            # a token id in plain decimal: int() would also take " 5", "+5", "05", "5_0" and
            # other digits, so several keys could name (and bias) one token
            if not (k.isascii() and k.isdigit() and (k == "0" or k[0] != "0")):
                raise bad(
                    f"'logit_bias' keys must be token ids in plain decimal, got {k!r}", "logit_bias"
                )
            t = int(k)
            self.check_ids([t], "logit_bias")
            bias[t] = float(v)
        stop_ids = frozenset(req.stop_token_ids or ())  # the engine tests every token against it
        self.check_ids(sorted(stop_ids), "stop_token_ids")
        base = SamplingParams(
            max_tokens=max_tokens,
            temperature=_temperature(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            # top_k >= the vocabulary keeps every token, as 0 does (and a huge one would
            # overflow the batch's int64 tensor, failing every request in the step)
            top_k=0 if not req.top_k or req.top_k >= self.vocab_size else req.top_k,
            min_p=req.min_p or 0.0,
            stop=req.stop_list(),
            stop_token_ids=stop_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias,
            skip_special_tokens=req.skip_special_tokens,
        )
        out = []
        for i in range(req.n):
            seed = None
            if req.seed is not None:
                seed = req.seed + i
                if seed > SEED_MAX:  # wrap within torch's accepted range
                    seed = seed - SEED_MAX - 1 + SEED_MIN
            out.append(dataclasses.replace(base, seed=seed))
        return out, max_tokens

    def prepare_completion(self, body: dict) -> Prepared:
        """Validate a ``/v1/completions`` body. Raises: APIError (400 / 404)."""
        body = check_unsupported(body)
        req = parse(CompletionRequest, body)
        self.check_model(req.model)
        p = req.prompt
        raw: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not raw:
            raise bad("'prompt' must not be empty", "prompt")
        if len(raw) * req.n > MAX_CHOICES:
            raise bad(
                f"{len(raw)} prompts x n={req.n} is {len(raw) * req.n} choices; one request may "
                f"have at most {MAX_CHOICES}",
                "n",
            )
        prompts: list[list[int]] = []
        echo_texts: list[str] = []
        for i, item in enumerate(raw):
            param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                if not item:
                    raise bad(f"'{param}' must not be empty", param)
                self.check_text_length(len(item), param)
                ids = list(self.tokenizer(item)["input_ids"])
                text = item
            else:
                ids = list(item)
                if not ids:
                    raise bad(f"'{param}' must not be empty", param)
                text = ""
            if not ids:
                raise bad(f"'{param}' tokenizes to zero tokens", param)
            self.check_ids(ids, param)
            if req.echo and not text:
                text = self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
            prompts.append(ids)
            echo_texts.append(text if req.echo else "")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params: list[SamplingParams] = []
        for i, ids in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            ps, _ = self._params(req, len(ids), max_tokens, "max_tokens", param)
            params = ps  # identical per prompt apart from the length checks
        for sp in params:
            sp.logprobs = req.logprobs
            if req.echo and req.logprobs is not None:  # echoed prompt tokens carry logprobs too
                sp.prompt_logprobs = req.logprobs
        so = req.stream_options
        return Prepared(
            prompts,
            echo_texts,
            params,
            req.stream,
            bool(so and so.include_usage),
            bool(so and so.include_usage and so.continuous_usage_stats),
            False,
            req.logprobs,
            req.return_tokens_as_token_ids,
        )

    def _messages(self, msgs: list, param: str = "messages") -> list[dict]:
        norm = []
        for i, m in enumerate(msgs):
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            elif content is None:
                # OpenAI allows a null/missing content only on assistant messages (tool calls)
                if m.role != "assistant":
                    missing = "content" not in m.model_fields_set
                    raise bad(
                        f"'{param}[{i}].content' is {'missing' if missing else 'null'}; "
                        f"{m.role} messages need a string or a list of text parts",
                        f"{param}[{i}].content",
                        "missing_required_parameter" if missing else "invalid_value",
                    )
                content = ""
            if m.tool_calls or m.tool_call_id:
                raise bad(
                    "tool calls are not supported by this server",
                    f"{param}[{i}].tool_calls" if m.tool_calls else f"{param}[{i}].tool_call_id",
                    "unsupported_parameter",
                )
            d = {"role": m.role, "content": content}
            if m.name is not None:
                d["name"] = m.name
            norm.append(d)
        return norm

    def prepare_chat(self, body: dict) -> Prepared:
        """Validate a ``/v1/chat/completions`` body. Raises: APIError (400 / 404)."""
        body = check_unsupported(body)
        req = parse(ChatCompletionRequest, body)
        self.check_model(req.model)
        messages = self._messages(req.messages)
        self.check_text_length(sum(len(m["content"]) for m in messages), "messages")
        ids = self.render_chat(
            messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        self.check_ids(ids, "messages")
        key = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params, _ = self._params(req, len(ids), mt, key, "messages")
        lp = (req.top_logprobs or 0) if req.logprobs else None
        for sp in params:
            sp.logprobs = lp
        so = req.stream_options
        return Prepared(
            [ids],
            [""],
            params,
            req.stream,
            bool(so and so.include_usage),
            bool(so and so.include_usage and so.continuous_usage_stats),
            True,
            lp,
            req.return_tokens_as_token_ids,
        )

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` under the tokenizer's chat template (or a plain fallback).

        Args:
            messages: ``[{"role", "content"[, "name"]}]`` (:meth:`_messages`).
            add_generation_prompt: end with the opening of an assistant turn.
            continue_final_message: end inside the last message, which the model continues
                (transformers' ``apply_chat_template`` option of that name).
            template_kwargs: extra template variables (``chat_template_kwargs``).

        Raises:
            APIError: 400 naming ``chat_template_kwargs.<key>`` for a key the template does not
                use or that names one of ``apply_chat_template``'s own arguments; 400 naming
                ``messages`` when the template refuses the messages (its ``raise_exception``,
                e.g. roles that do not alternate) or cannot continue the final message.
        """
        tok = self.tokenizer
        template = getattr(tok, "chat_template", None)
        kwargs = dict(template_kwargs or {})
        if kwargs:
            self._check_template_kwargs(template, kwargs)
        if not template:  # plain fallback
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
            if continue_final_message:
                text = text[:-1]  # no newline closing the last message
            elif add_generation_prompt:
                text += "<|assistant|>\n"
            if getattr(tok, "bos_token", None):
                text = tok.bos_token + text
            return list(tok(text, add_special_tokens=False)["input_ids"])
        try:
            text = tok.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except RecursionError:  # transformers copies the variables recursively
            raise bad(
                "'chat_template_kwargs' values are nested too deeply", "chat_template_kwargs"
            ) from None
        except (TemplateError, ValueError, TypeError) as exc:
            raise bad(
                f"the model's chat template refused these messages: {exc}", "messages"
            ) from None
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _check_template_kwargs(self, template: str | None, kwargs: dict[str, Any]) -> None:
        """``chat_template_kwargs`` must act: each key a variable the template reads, none of
        ``apply_chat_template``'s own arguments (those have request fields or are ours)."""
        if not template:
            key = next(iter(kwargs))
            raise bad(
                "'chat_template_kwargs' needs a chat template; this model has none",
                f"chat_template_kwargs.{key}",
                "unsupported_parameter",
            )
        used = _template_variables(template)
        own = set(inspect.signature(self.tokenizer.apply_chat_template).parameters) | {"messages"}
        for key in kwargs:
            if key in own:
                raise bad(
                    f"'chat_template_kwargs.{key}' is an argument of the template call, not a "
                    "template variable"
                    + (
                        f"; use the request field '{key}'"
                        if key in ("add_generation_prompt", "continue_final_message")
                        else ""
                    ),
                    f"chat_template_kwargs.{key}",
                )
            if used is not None and key not in used:
                raise bad(
                    f"'chat_template_kwargs.{key}' is not used by this model's chat template "
                    f"(it reads: {', '.join(sorted(used)) or 'no extra variables'})",
                    f"chat_template_kwargs.{key}",
                    "unsupported_parameter",
                )

    # ---- tokenize / detokenize --------------------------------------------------------
    def tokenize(self, body: dict) -> TokenizeResponse:
        """``POST /tokenize``. Raises: APIError (400 / 404)."""
        req = parse(TokenizeRequest, body)
        self.check_model(req.model)
        if req.messages is not None:
            ids = self.render_chat(
                self._messages(req.messages),
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
            )
            if req.add_special_tokens:
                raise bad(
                    "'add_special_tokens' with 'messages' is not supported (the chat template "
                    "adds them)",
                    "add_special_tokens",
                    "unsupported_parameter",
                )
        else:
            set_ = [
                key
                for key, on in (
                    ("add_generation_prompt", req.add_generation_prompt is not True),
                    ("continue_final_message", req.continue_final_message),
                    ("chat_template_kwargs", bool(req.chat_template_kwargs)),
                )
                if on
            ]
            if set_:  # they shape a chat rendering: with a prompt they could not act
                raise bad(f"'{set_[0]}' applies to 'messages' only, not 'prompt'", set_[0])
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = list(self.tokenizer(req.prompt, add_special_tokens=add)["input_ids"])
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_context, tokens=ids, token_strs=strs
        )

    def detokenize(self, body: dict) -> DetokenizeResponse:
        """``POST /detokenize``. Raises: APIError (400 / 404)."""
        req = parse(DetokenizeRequest, body)
        self.check_model(req.model)
        self.check_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    # ---- generation -------------------------------------------------------------------
    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            if len(self._token_strs) < 1_000_000:
                self._token_strs[token_id] = s
        return s

    def token_name(self, token_id: int, as_id: bool) -> str:
        """How logprobs name a token: its text, or ``"token_id:<id>"`` (vLLM's
        ``return_tokens_as_token_ids``: unique, where texts collide, e.g. partial UTF-8 bytes)."""
        return f"token_id:{token_id}" if as_id else self.token_str(token_id)

    def completion_logprobs(
        self, events: list[TokenEvent], offset: int, k: int, as_ids: bool = False
    ) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for ev in events:
            s = self.token_name(ev.token_id, as_ids)
            out.text_offset.append(offset)
            offset += len(s)
            out.tokens.append(s)
            out.token_logprobs.append(ev.logprob)
            top: dict[str, float] = {}
            if ev.logprob is not None:
                top[s] = ev.logprob
            for t, lp in (ev.top_logprobs or [])[:k]:
                # tokens that decode alike (e.g. partial UTF-8 bytes) share a key: keep the first
                top.setdefault(self.token_name(t, as_ids), lp)
            out.top_logprobs.append(top)
        return out

    def echo_logprobs(
        self,
        prompt_ids: list[int],
        rows: list[tuple[float, list[tuple[int, float]]] | None] | None,
        k: int,
        as_ids: bool = False,
    ) -> CompletionLogProbs:
        """Completions ``logprobs`` of the echoed prompt tokens (as vLLM's ``echo`` with
        ``logprobs``): the first token's logprob and top logprobs are ``null``; offsets from 0.

        Raises:
            RuntimeError: the engine delivered no prompt logprobs for a requested echo.
        """
        if rows is None or len(rows) != len(prompt_ids):
            raise RuntimeError("the engine returned no prompt logprobs for 'echo' with 'logprobs'")
        out = CompletionLogProbs()
        offset = 0
        for i, t in enumerate(prompt_ids):
            s = self.token_name(t, as_ids)
            out.text_offset.append(offset)
            offset += len(s)
            out.tokens.append(s)
            row = rows[i]
            if i == 0 or row is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            lp, tops = row
            out.token_logprobs.append(lp)
            top = {s: lp}
            for tt, tlp in tops[:k]:
                top.setdefault(self.token_name(tt, as_ids), tlp)
            out.top_logprobs.append(top)
        return out

    def _choice_logprobs(
        self, prep: Prepared, ch: _Choice, events: list[TokenEvent], offset: int, first: bool
    ) -> tuple[CompletionLogProbs, int]:
        """Completions ``logprobs`` of ``events`` and the text offset after them. With ``echo``,
        on the choice's first chunk the prompt tokens' come first and offsets count from 0 over
        the token strings (as vLLM: ``offset`` is then ignored)."""
        assert prep.logprobs is not None
        if not (
            first and prep.echo_texts[ch.prompt] and prep.params[0].prompt_logprobs is not None
        ):
            gen = self.completion_logprobs(events, offset, prep.logprobs, prep.tokens_as_ids)
            return gen, offset + sum(len(t) for t in gen.tokens)
        head = self.echo_logprobs(
            prep.prompts[ch.prompt],
            events[0].prompt_logprobs if events else None,
            prep.logprobs,
            prep.tokens_as_ids,
        )
        offset = sum(len(t) for t in head.tokens)
        gen = self.completion_logprobs(events, offset, prep.logprobs, prep.tokens_as_ids)
        return CompletionLogProbs(
            text_offset=head.text_offset + gen.text_offset,
            token_logprobs=head.token_logprobs + gen.token_logprobs,
            tokens=head.tokens + gen.tokens,
            top_logprobs=head.top_logprobs + gen.top_logprobs,
        ), offset + sum(len(t) for t in gen.tokens)

    def chat_logprobs(self, events: list[TokenEvent], as_ids: bool = False) -> ChatLogProbs:
        content = []
        for ev in events:
            if ev.logprob is None:  # the engine gives every token one when logprobs were asked
                raise RuntimeError(f"token {ev.token_id} came without the requested logprob")
            # ``bytes`` stay the UTF-8 of the token's text (OpenAI: the token's bytes) when
            # ``token`` names it by id
            tops = [
                TopLogprob(
                    token=self.token_name(t, as_ids),
                    logprob=lp,
                    bytes=list(self.token_str(t).encode()),
                )
                for t, lp in ev.top_logprobs or []
            ]
            content.append(
                ChatTokenLogprob(
                    token=self.token_name(ev.token_id, as_ids),
                    logprob=ev.logprob,
                    bytes=list(self.token_str(ev.token_id).encode()),
                    top_logprobs=tops,
                )
            )
        return ChatLogProbs(content=content)

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
        if not isinstance(resp, StreamingResponse):  # a stream drops q when it ends (_sse)
            self._queues.discard(q)
        return resp

    async def _generate(self, request: Request, prep: Prepared, loop, q: asyncio.Queue):
        n = len(prep.params)
        choices: list[_Choice] = []
        box = self._mailbox
        if box is None or box.loop is not loop:
            box = self._mailbox = EventMailbox(loop)
        for p in range(len(prep.prompts)):
            for i in range(n):
                idx = len(choices)

                def on_event(ev, _idx=idx) -> None:
                    box.post(q, (_idx, ev))

                req = self.engine.submit(prep.prompts[p], prep.params[i], on_event)
                choices.append(_Choice(index=idx, prompt=p, req=req))
        rid = ("chatcmpl-" if prep.chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        label = self.client_id

        def cancel_all() -> None:
            for ch in choices:
                if not ch.req.done:
                    ch.req.cancel()

        def usage() -> UsageInfo:
            pt = sum(len(ids) for ids in prep.prompts)
            ct = sum(len(ch.req.output_ids) for ch in choices)
            return UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)

        if prep.stream:
            # An error before the first token (no live replica, a bad prompt found by the engine)
            # is answered with its HTTP status, not as a 200 stream that carries the error. A
            # client that leaves before then (queued behind --max-num-seqs) is cancelled at once.
            watcher = asyncio.create_task(self._watch_disconnect(request, cancel_all, q))
            try:
                head = await q.get()
            finally:
                watcher.cancel()
            if head[1] is _GONE:
                metrics.REQUESTS.labels(client_id=label, status="cancelled").inc()
                return Response(status_code=499)
            if isinstance(head[1], ErrorEvent):
                cancel_all()
                err = exc_error(head[1].error)
                metrics.REQUESTS.labels(client_id=label, status=str(err.status)).inc()
                return err.response()
            return StreamingResponse(
                self._sse(prep, choices, q, rid, created, usage, cancel_all, head),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        watcher = asyncio.create_task(self._watch_disconnect(request, cancel_all, q))
        left = len(choices)
        try:
            while left:
                idx, ev = await q.get()
                if ev is _GONE:
                    raise _ClientGone()
                ch = choices[idx]
                if isinstance(ev, ErrorEvent):
                    cancel_all()
                    err = exc_error(ev.error)
                    metrics.REQUESTS.labels(client_id=label, status=str(err.status)).inc()
                    return err.response()
                ch.events.append(ev)
                if ev.finish_reason is not None:
                    ch.finish, ch.stop_reason = ev.finish_reason, ev.stop_reason
                    left -= 1
        except BaseException as exc:
            cancel_all()
            if isinstance(exc, (_ClientGone, asyncio.CancelledError)):
                metrics.REQUESTS.labels(client_id=label, status="cancelled").inc()
            if isinstance(exc, _ClientGone):
                return Response(status_code=499)
            raise  # anything else is a bug: the app's handler answers (and counts) a JSON 500
        finally:
            watcher.cancel()
        metrics.REQUESTS.labels(client_id=label, status="200").inc()

        def build() -> ChatCompletionResponse | CompletionResponse:
            if prep.chat:
                return ChatCompletionResponse(
                    id=rid,
                    created=created,
                    model=self.model_name,
                    choices=[
                        ChatChoice(
                            index=ch.index,
                            message=ChatMessageOut(content=ch.req.text),
                            logprobs=self.chat_logprobs(ch.events, prep.tokens_as_ids)
                            if prep.logprobs is not None
                            else None,
                            finish_reason=ch.finish,
                            stop_reason=ch.stop_reason,
                            token_ids=list(ch.req.output_ids),
                        )
                        for ch in choices
                    ],
                    usage=usage(),
                )
            return CompletionResponse(
                id=rid,
                created=created,
                model=self.model_name,
                choices=[
                    CompletionChoice(
                        index=ch.index,
                        text=prep.echo_texts[ch.prompt] + ch.req.text,
                        logprobs=self._choice_logprobs(
                            prep, ch, ch.events, len(prep.echo_texts[ch.prompt]), True
                        )[0]
                        if prep.logprobs is not None
                        else None,
                        finish_reason=ch.finish,
                        stop_reason=ch.stop_reason,
                        token_ids=list(ch.req.output_ids),
                    )
                    for ch in choices
                ],
                usage=usage(),
            )

        # built and encoded in a worker thread, one choice per encoder call: a response of n=128
        # choices with 20 logprobs per token is tens of MB, and encoded on the event loop (or in
        # one call, which holds the GIL throughout) it stalled every stream and /health
        def encode() -> bytes:
            resp = build()
            rest = resp.model_dump(exclude={"choices"})
            head = {k: rest.get(k) for k in type(resp).model_fields}  # OpenAI's key order
            parts = (json_bytes(c.model_dump()) for c in resp.choices)
            return json_bytes_with_array(head, "choices", parts)

        return Response(content=await asyncio.to_thread(encode), media_type="application/json")

    @staticmethod
    async def _watch_disconnect(request: Request, cancel_all, q: asyncio.Queue) -> None:
        """Poll the connection every ``DISCONNECT_POLL_S`` (on its own clock: while tokens keep
        arriving the event queue never idles); when the client is gone, cancel every choice
        and queue ``_GONE``."""
        try:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
        except Exception:  # noqa: BLE001  (receive channel unusable: stop watching)
            log.debug("disconnect watcher stopped", exc_info=True)
            return
        cancel_all()
        q.put_nowait((-1, _GONE))

    async def _sse(
        self, prep, choices, q, rid, created, usage, cancel_all, head=None
    ) -> AsyncIterator[str]:
        """The SSE body; ``head`` is the first ``(choice index, event)``, already taken off ``q``."""
        label = self.client_id
        status = "cancelled"

        def data(obj: dict) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        def dump(chunk: ChatCompletionChunk | CompletionChunk, ch: _Choice) -> dict:
            d = chunk.model_dump()
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

        offsets = {ch.index: len(prep.echo_texts[ch.prompt]) for ch in choices}
        try:
            if prep.chat:
                for ch in choices:
                    yield data(
                        dump(
                            ChatCompletionChunk(
                                id=rid,
                                created=created,
                                model=self.model_name,
                                choices=[
                                    ChatChunkChoice(
                                        index=ch.index,
                                        delta=DeltaMessage(role="assistant", content=""),
                                    )
                                ],
                            ),
                            ch,
                        )
                    )
            left = len(choices)
            first = {ch.index for ch in choices}
            while left:
                if head is not None:
                    (idx, ev), head = head, None
                else:
                    idx, ev = await q.get()
                if ev is _GONE:  # the pre-head watcher saw the client leave as the head came
                    return
                ch = choices[idx]
                if isinstance(ev, ErrorEvent):
                    cancel_all()
                    err = exc_error(ev.error)
                    status = str(err.status)
                    body = err.body()
                    body["error"]["param"] = None
                    yield data(body)
                    yield "data: [DONE]\n\n"
                    return
                ch.events.append(ev)
                if ev.finish_reason is not None:
                    ch.finish, ch.stop_reason = ev.finish_reason, ev.stop_reason
                    left -= 1
                chunk: ChatCompletionChunk | CompletionChunk
                if prep.chat:
                    chunk = ChatCompletionChunk(
                        id=rid,
                        created=created,
                        model=self.model_name,
                        choices=[
                            ChatChunkChoice(
                                index=ch.index,
                                delta=DeltaMessage(content=ev.text),
                                logprobs=self.chat_logprobs([ev], prep.tokens_as_ids)
                                if prep.logprobs is not None
                                else None,
                                finish_reason=ev.finish_reason,
                                stop_reason=ev.stop_reason,
                                token_ids=[ev.token_id],
                            )
                        ],
                    )
                else:
                    text = ev.text
                    if ch.index in first:
                        text = prep.echo_texts[ch.prompt] + text
                    lp = None
                    if prep.logprobs is not None:
                        lp, offsets[ch.index] = self._choice_logprobs(
                            prep, ch, [ev], offsets[ch.index], ch.index in first
                        )
                    chunk = CompletionChunk(
                        id=rid,
                        created=created,
                        model=self.model_name,
                        choices=[
                            CompletionChoice(
                                index=ch.index,
                                text=text,
                                logprobs=lp,
                                finish_reason=ev.finish_reason,
                                stop_reason=ev.stop_reason,
                                token_ids=[ev.token_id],
                            )
                        ],
                    )
                first.discard(ch.index)
                yield data(dump(chunk, ch))
            if prep.include_usage:
                cls = ChatCompletionChunk if prep.chat else CompletionChunk
                final = cls(id=rid, created=created, model=self.model_name, choices=[])
                d = final.model_dump()
                d["usage"] = usage().model_dump()
                yield data(d)
            yield "data: [DONE]\n\n"
            status = "200"
        except Exception as exc:  # a bug while building a chunk: end the stream with an error
            log.exception("stream %s failed", rid)
            status = "500"
            yield data(exc_error(exc).body())
            yield "data: [DONE]\n\n"
        finally:
            self._queues.discard(q)
            cancel_all()
            metrics.REQUESTS.labels(client_id=label, status=status).inc()


__all__ = [
    "DEFAULT_MAX_REQUEST_BODY",
    "OpenAIServer",
    "ServerShuttingDown",
    "Prepared",
    "exc_error",
    "UNSUPPORTED",
]
