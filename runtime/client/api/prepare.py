"""Request bodies to engine inputs: validation, tokenization, sampling parameters.

:class:`RequestPreparer` turns a ``/v1/completions`` or ``/v1/chat/completions`` body
(:mod:`.protocol`) into a :class:`Prepared`: the prompts' token ids and ``n`` sampling
parameters per prompt (a seeded request's choice ``i`` uses seed ``seed + i``), after every
check that can refuse it with a 400 or 404 (model name, context length, token ids outside the
vocabulary, sampling fields); it also answers ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from eaas.runtime.client.api.bodies import DetokenizeResponse, TokenizeResponse
from eaas.runtime.client.api.chat_template import normalize_messages, render_chat
from eaas.runtime.client.api.protocol import (
    COMPLETION_UNSUPPORTED,
    MAX_CHOICES,
    SEED_MAX,
    SEED_MIN,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    TokenizeRequest,
    _SamplingFields,
    bad,
    check_unsupported,
    parse,
)
from eaas.runtime.client.sampling import SAMPLING_EPS, SamplingParams
from eaas.runtime.client.structured import Grammar, GrammarCompiler, GrammarError


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
        echo: ``echo`` was asked (the echoed text may be ``""``: ids that decode to nothing).
        prompt_logprobs: ``None`` or vLLM's ``prompt_logprobs`` (top tokens per prompt token).
        return_token_ids: vLLM's ``return_token_ids`` (``None``: not sent).
        role: the role of the answer (chat: ``assistant``, or the last message's role with
            ``add_generation_prompt: false``, as vLLM).
        max_tokens: per prompt, the ``max_tokens`` its choices use (``None``: ``params``'),
            so that the default of 16 is clamped to each prompt's room.
        tool_call: chat with ``tool_choice`` ``"required"`` (``"required"``) or a named
            function (its name): the answer becomes ``tool_calls``; else ``None``.
        beam_search, length_penalty: vLLM's ``use_beam_search`` (``n`` beams per prompt,
            :mod:`.beam`) and its score's length exponent.
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
    echo: bool = False
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    role: str = "assistant"
    max_tokens: list[int] | None = None
    tool_call: str | None = None
    beam_search: bool = False
    length_penalty: float = 1.0


def sampling_temperature(value: float | None) -> float:
    """The request's temperature for :class:`SamplingParams`: 1 when not given (OpenAI's
    default), 0 (greedy) below :data:`SAMPLING_EPS` (vLLM)."""
    if value is None:
        return 1.0
    return 0.0 if value < SAMPLING_EPS else float(value)


class RequestPreparer:
    """Validates request bodies against the served model and prepares them for the engine.

    Args:
        tokenizer: the model's tokenizer.
        model_name: id accepted in ``model`` (and carried by the answers).
        aliases: other ids accepted in ``model`` (``--served-model-name a,b``).
        max_context: ``max_position_embeddings`` (prompt + completion tokens limit).
        vocab_size: valid token ids are ``[0, vocab_size)`` (the model's embedding rows).
    """

    def __init__(
        self,
        tokenizer,
        model_name: str,
        max_context: int,
        vocab_size: int,
        aliases: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.names = frozenset((model_name, *aliases))
        self.max_context = int(max_context)
        self.vocab_size = int(vocab_size)
        self._max_token_chars: int | None = None  # longest vocabulary entry (check_text_length)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size)

    def check_model(self, model: str | None) -> None:
        """Raises: APIError 404 ``model_not_found`` for a model this server does not serve
        (``None`` and ``""`` name the served one, as vLLM)."""
        if model and model not in self.names:
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

    def truncate(self, ids: list[int], keep: int, side: str) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last (``side`` ``"left"``) or first
        (``"right"``) ``keep`` ids; ``-1`` keeps the context's length."""
        keep = self.max_context if keep == -1 else keep
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep :] if side == "left" else ids[:keep]

    def check_ids(self, ids: list[int], param: str) -> None:
        """Raises: APIError 400 when an id is outside ``[0, vocab_size)``."""
        bad_ids = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise bad(
                f"'{param}' has token ids outside the model's vocabulary [0, {self.vocab_size}): "
                f"{bad_ids[:5]}",
                param,
            )

    def sampling_params(
        self,
        req: _SamplingFields,
        n_prompt: int,
        max_tokens: int | None,
        key: str,
        param: str,
        default: int | None = None,
    ) -> tuple[list[SamplingParams], int]:
        """The ``n`` sampling parameters of a prompt of ``n_prompt`` tokens and the
        ``max_tokens`` they use (``None``: ``default`` clamped to the room the context leaves,
        or all of that room without a default). ``key`` names the ``max_tokens`` field in
        errors, ``param`` the prompt.

        Raises:
            APIError: 400 ``context_length_exceeded``; 400 for ``min_tokens`` over
                ``max_tokens``, ``logit_bias`` keys that are not plain decimal token ids, token
                ids outside the vocabulary.
        """
        room = self.max_context - n_prompt
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt "
                f"has {n_prompt} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:  # not sent: a default never makes the request fail
            max_tokens = room if default is None else min(default, room)
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
        self.check_ids(req.logprob_token_ids or [], "logprob_token_ids")
        allowed = None
        if req.allowed_token_ids is not None:
            self.check_ids(req.allowed_token_ids, "allowed_token_ids")
            allowed = frozenset(req.allowed_token_ids)
        base = SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling_temperature(req.temperature),
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
            allowed_token_ids=allowed,
            logprob_token_ids=tuple(req.logprob_token_ids or ()) or None,
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

    def grammar(self, req: _SamplingFields, schema: dict | None = None) -> Grammar | None:
        """The request's compiled constraint: ``structured_outputs``, ``response_format``
        (``json_object`` / ``json_schema``, as vLLM maps them) or a tool call's ``schema``;
        ``None`` without one.

        Raises:
            APIError: 400 naming the field whose constraint does not compile.
        """
        so, rf = req.structured_outputs, req.response_format
        any_ws, no_extra = True, False
        spec: Any
        if schema is not None:
            kind, spec, param = "json", schema, "tools"
        elif so is not None:
            ((kind, spec),) = so.constraints().items()
            param = f"structured_outputs.{kind}"
            any_ws, no_extra = not so.disable_any_whitespace, so.disable_additional_properties
        elif rf is not None and rf.type == "json_object":
            kind, spec, param = "json_object", None, "response_format"
        elif rf is not None and rf.type == "json_schema":
            assert rf.json_schema is not None
            kind, spec, param = "json", rf.json_schema.schema_, "response_format.json_schema"
        else:
            return None
        if kind == "json_object" and spec is False:
            return None
        if kind == "json" and no_extra and isinstance(spec, dict):
            spec = _no_additional_properties(spec)
        try:
            return self.grammars.compile(kind, spec, param, any_whitespace=any_ws)
        except GrammarError as exc:
            raise bad(str(exc), exc.param) from None

    def prepare_completion(self, body: dict) -> Prepared:
        """Validate a ``/v1/completions`` body. Raises: APIError (400 / 404)."""
        body = check_unsupported(body, COMPLETION_UNSUPPORTED)
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
            if req.truncate_prompt_tokens is not None:
                cut = self.truncate(ids, req.truncate_prompt_tokens, req.truncation_side)
                if len(cut) != len(ids):
                    ids, text = cut, ""  # echo the prompt the model saw
            self.check_ids(ids, param)
            if req.echo and not text:
                # as vLLM: the ids' text with their special tokens ([0, 0] -> "<s><s>")
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
            prompts.append(ids)
            echo_texts.append(text if req.echo else "")
        params: list[SamplingParams] = []
        per_prompt: list[int] = []
        for i, ids in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            # OpenAI's default of 16 when not sent, clamped to the room a long prompt leaves (a
            # 2040-token prompt of a 2048 context got a 400 naming a field never sent)
            ps, mt = self.sampling_params(req, len(ids), req.max_tokens, "max_tokens", param, 16)
            params = ps  # identical per prompt apart from max_tokens
            per_prompt.append(mt)
        # echoed prompt tokens carry logprobs too: the engine computes them in the prefill
        # forward, as it does vLLM's prompt_logprobs (one k serves both)
        want = [
            k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None
        ]
        grammar = self.grammar(req)
        # logprob_token_ids replace the top `logprobs` (vLLM: their count is what is listed)
        k = len(req.logprob_token_ids) if req.logprob_token_ids else req.logprobs
        for sp in params:
            sp.logprobs = k
            sp.prompt_logprobs = max(want) if want else None
            sp.grammar = grammar
        so = req.stream_options
        return Prepared(
            prompts,
            echo_texts,
            params,
            req.stream,
            bool(so and so.include_usage),
            bool(so and so.include_usage and so.continuous_usage_stats),
            False,
            k,
            req.return_tokens_as_token_ids,
            echo=req.echo,
            prompt_logprobs=req.prompt_logprobs,
            return_token_ids=req.return_token_ids,
            max_tokens=per_prompt,
            beam_search=req.use_beam_search,
            length_penalty=req.length_penalty,
        )

    def prepare_chat(self, body: dict) -> Prepared:
        """Validate a ``/v1/chat/completions`` body. Raises: APIError (400 / 404)."""
        body = check_unsupported(body)
        req = parse(ChatCompletionRequest, body)
        self.check_model(req.model)
        messages = normalize_messages(req.messages)
        self.check_text_length(sum(len(m["content"]) for m in messages), "messages")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = render_chat(
            self.tokenizer,
            messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            tools=tools,
        )
        tool_call, schema = None, None
        if req.stream and req.tool_choice not in (None, "none"):
            raise bad(
                "'tool_choice' 'required' or a named function is not available with "
                "'stream': true on this server (send the request without streaming)",
                "tool_choice",
                "unsupported_parameter",
            )
        if isinstance(req.tool_choice, NamedToolChoice):
            tool_call = req.tool_choice.function.name
            fn = next(t.function for t in req.tools or () if t.function.name == tool_call)
            schema = _params_schema(fn.parameters)
        elif req.tool_choice == "required":
            tool_call = "required"
            schema = _tools_schema(req.tools or [], req.parallel_tool_calls)
        if req.truncate_prompt_tokens is not None:
            ids = self.truncate(ids, req.truncate_prompt_tokens, req.truncation_side)
        self.check_ids(ids, "messages")
        key = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params, _ = self.sampling_params(req, len(ids), mt, key, "messages")
        lp = (req.top_logprobs or 0) if req.logprobs else None
        grammar = self.grammar(req, schema)
        for sp in params:
            sp.logprobs = lp
            sp.prompt_logprobs = req.prompt_logprobs
            sp.grammar = grammar
        # vLLM: without a generation prompt the answer continues the last message, in its role
        role = "assistant" if req.add_generation_prompt else messages[-1]["role"]
        echo = ""
        if req.echo and messages[-1]["role"] == role:
            echo = messages[-1]["content"]
        so = req.stream_options
        return Prepared(
            [ids],
            [echo],
            params,
            req.stream,
            bool(so and so.include_usage),
            bool(so and so.include_usage and so.continuous_usage_stats),
            True,
            lp,
            req.return_tokens_as_token_ids,
            echo=req.echo,
            prompt_logprobs=req.prompt_logprobs,
            return_token_ids=req.return_token_ids,
            role=role,
            tool_call=tool_call,
            beam_search=req.use_beam_search,
            length_penalty=req.length_penalty,
        )

    def tokenize(self, body: dict) -> TokenizeResponse:
        """``POST /tokenize``. Raises: APIError (400 / 404)."""
        req = parse(TokenizeRequest, body)
        self.check_model(req.model)
        if req.messages is not None:
            ids = render_chat(
                self.tokenizer,
                normalize_messages(req.messages),
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                add_special_tokens=bool(req.add_special_tokens),  # vLLM: off for messages
                tools=req.tools,
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


def _params_schema(params: dict | None) -> dict:
    """A tool's ``parameters`` schema (none: an empty object, as vLLM)."""
    return params if params else {"type": "object", "properties": {}}


def _tools_schema(tools: list, parallel: bool | None) -> dict:
    """vLLM's schema for ``tool_choice: "required"``: a non-empty array of
    ``{"name": <one tool's name>, "parameters": <its schema>}`` (one item at most with
    ``parallel_tool_calls: false``); the tools' ``$defs`` merged at the top.

    Raises:
        APIError: 400 on ``tools`` when two tools define one ``$defs`` name differently.
    """
    items: list[dict] = []
    defs: dict[str, Any] = {}
    for t in tools:
        params = dict(_params_schema(t.function.parameters))
        for k, v in (params.pop("$defs", None) or {}).items():
            if k in defs and defs[k] != v:
                raise bad(f"tools define '$defs.{k}' with different schemas", "tools")
            defs[k] = v
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _no_additional_properties(schema: dict) -> dict:
    """``schema`` with ``additionalProperties: false`` on every object that does not set it
    (vLLM's ``disable_additional_properties``)."""

    def walk(x):
        if isinstance(x, dict):
            out = {k: walk(v) for k, v in x.items()}
            if (out.get("type") == "object" or "properties" in out) and (
                "additionalProperties" not in out
            ):
                out["additionalProperties"] = False
            return out
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(schema)
