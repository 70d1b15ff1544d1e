"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Shapes follow OpenAI's API reference (``/v1/completions``, ``/v1/chat/completions``) and vLLM's
server (``vllm/entrypoints/openai/protocol.py``) for its extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``ignore_eos``, ``/tokenize``, ``/detokenize``).

Validation is strict (no string-to-number coercion, ``NaN``/``Infinity`` rejected) and an
unknown field is an error, so nothing a client sends is silently ignored. :func:`parse` turns a
pydantic ``ValidationError`` into an :class:`APIError` (HTTP 400, OpenAI's error shape) whose
``param`` names the field (``messages[0].content``). Fields that OpenAI or vLLM define but this
server does not implement are listed in :data:`UNSUPPORTED` and rejected by name with a 400
unless they carry their no-op value.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# signed 64 bit, as vLLM (``_INT64_MIN`` / ``_INT64_MAX`` of its protocol): a seed outside is a
# 400 naming ``seed`` (torch would take unsigned 64-bit seeds too; vLLM's clients expect the 400)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # OpenAI: top_logprobs <= 20 (chat); completions logprobs <= 5, vLLM 20
MAX_N = 128  # OpenAI's limit of n
MAX_CHOICES = 4096  # prompts x n of one completions request (each choice is an engine request)


class APIError(Exception):
    """An error answered in OpenAI's JSON shape ``{"error": {message, type, param, code}}``."""

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

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())


def bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return APIError(400, message, "invalid_request_error", param, code)


# ---- known but unsupported fields ----------------------------------------------------------
# field -> values that mean "off" (accepted); any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "web_search_options": (None,),
    "bad_words": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "spaces_between_special_tokens": (None, True),
    "chat_template": (None,),
    "documents": (None,),
}
#: refused on /v1/completions only (chat implements them: tool_choice named / "required")
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
}


def check_unsupported(body: dict, extra_ok: dict[str, tuple[Any, ...]] | None = None) -> dict:
    """400 naming the first known-but-unsupported field that is set to a value that acts.

    Returns:
        ``body`` without the known-but-unsupported fields (all of them carry their no-op value
        by then), ready for the request model, which does not declare them.

    Raises:
        APIError: 400, code ``unsupported_parameter``.
    """
    table = {**UNSUPPORTED, **(extra_ok or {})}
    for key, off in table.items():
        if key in body and not any(body[key] == v and type(body[key]) is type(v) for v in off):
            if body[key] is None and None in off:
                continue
            raise bad(
                f"'{key}' is not supported by this server (got {body[key]!r})",
                key,
                "unsupported_parameter",
            )
    return {k: v for k, v in body.items() if k not in table}


# ---- field types -------------------------------------------------------------------------
StrictInt = Annotated[int, Field(strict=True)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # JSON null on a top-level field means "not given" (the field's default applies)
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one constraint (``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``) and its options; compiled with xgrammar
    (:mod:`eaas.runtime.client.structured`)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.structural_tag is not None:
            raise _FieldError(
                "structured_outputs.structural_tag",
                "'structured_outputs.structural_tag' is not supported by this server",
            )
        if self.whitespace_pattern is not None:  # vLLM refuses it with xgrammar too
            raise _FieldError(
                "structured_outputs.whitespace_pattern",
                "'structured_outputs.whitespace_pattern' is not supported (xgrammar backend)",
            )
        if len(self.constraints()) != 1:
            raise _FieldError(
                "structured_outputs",
                "'structured_outputs' needs exactly one of 'json', 'regex', 'choice', 'grammar' "
                f"and 'json_object', got {len(self.constraints())}",
            )
        return self

    def constraints(self) -> dict[str, Any]:
        """``{kind: spec}`` of the constraints set (one after validation)."""
        out = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
        }
        return {k: v for k, v in out.items() if v is not None}


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object)
    or ``json_schema`` (its ``schema``), as vLLM maps them to structured outputs."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise _FieldError(
                "response_format.json_schema",
                "'response_format' of type 'json_schema' needs 'json_schema'",
            )
        return self


class _SamplingFields(_Strict):
    """Fields shared by completions and chat (OpenAI + vLLM extensions)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    temperature: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(allow_inf_nan=False, gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    min_p: Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] = 1
    best_of: Annotated[int, Field(strict=True, ge=1)] | None = None
    seed: Annotated[int, Field(strict=True, ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(allow_inf_nan=False, ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False, ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(allow_inf_nan=False, gt=0.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False, ge=-100, le=100)]] | None = (
        None
    )
    min_tokens: Annotated[int, Field(strict=True, ge=0)] = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM)
    # vLLM: true adds token_ids (the generated ids) and prompt_token_ids; else both are null
    return_token_ids: bool | None = None
    # vLLM: logprobs of every prompt token after the first, k most likely each, computed in the
    # prefill forward of this request
    prompt_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None
    user: str | None = None  # OpenAI: an end-user id for the operator's records; no effect here
    # vLLM: keep only this many prompt tokens (-1: the context), from the truncation_side end
    truncate_prompt_tokens: Annotated[int, Field(strict=True, ge=-1)] | None = None
    truncation_side: Literal["left", "right"] = "left"
    # vLLM: with logprobs, these ids' logprobs in place of the top k (at most 128)
    logprob_token_ids: Annotated[list[StrictInt], Field(max_length=128)] | None = None
    # vLLM: only these token ids can be sampled (a logits mask; logprobs stay raw)
    allowed_token_ids: Annotated[list[StrictInt], Field(min_length=1)] | None = None
    # vLLM: beam search of n beams (runtime/client/api/beam.py), scored with length_penalty
    use_beam_search: bool = False
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] = 1.0
    # guided decoding, as vLLM (xgrammar): structured_outputs, or OpenAI's response_format
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _cross_field(self):
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stop) > 4:
            raise _FieldError("stop", "'stop' accepts at most 4 sequences")
        if any(not s for s in stop):  # it would match everywhere; vLLM refuses it too
            raise _FieldError("stop", "'stop' must not contain an empty string")
        if self.stream_options is not None and not self.stream:
            raise _FieldError(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )
        lp = getattr(self, "logprobs", None)  # completions: int k (0 counts); chat: bool
        if self.return_tokens_as_token_ids and (lp is None or lp is False):
            raise _FieldError(
                "return_tokens_as_token_ids",
                "'return_tokens_as_token_ids' names the tokens of logprobs: it needs 'logprobs'",
            )
        if self.truncate_prompt_tokens == 0:  # would leave no prompt at all
            raise _FieldError(
                "truncate_prompt_tokens",
                "'truncate_prompt_tokens' must be -1 (the context) or >= 1, got 0",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise _FieldError(
                "prompt_logprobs", "'prompt_logprobs' is not available with 'stream': true (vLLM)"
            )
        lp = getattr(self, "logprobs", None)
        if self.logprob_token_ids and (lp is None or lp is False):
            raise _FieldError("logprob_token_ids", "'logprob_token_ids' needs 'logprobs' (as vLLM)")
        if self.use_beam_search:
            for key, on in (
                ("stream", self.stream),
                ("logprobs", lp is not None and lp is not False),
                ("echo", getattr(self, "echo", False)),
                ("prompt_logprobs", self.prompt_logprobs is not None),
                ("structured_outputs", self.structured_outputs is not None),
                ("response_format", self.response_format not in (None,)),
                ("allowed_token_ids", self.allowed_token_ids is not None),
                ("logprob_token_ids", bool(self.logprob_token_ids)),
                ("tool_choice", getattr(self, "tool_choice", None) not in (None, "none")),
            ):
                if on:
                    raise _FieldError(
                        key, f"'{key}' is not available with 'use_beam_search' on this server"
                    )
        elif self.length_penalty != 1.0:
            raise _FieldError("length_penalty", "'length_penalty' needs 'use_beam_search'")
        rf = self.response_format
        if self.structured_outputs is not None and rf is not None and rf.type != "text":
            raise _FieldError(
                "response_format",
                "give either 'response_format' or 'structured_outputs', not both",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise _FieldError(
                "best_of",
                f"'best_of' other than n is not supported (got best_of={self.best_of}, n={self.n})",
            )
        return self

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return list(stop)


class _FieldError(ValueError):
    """Raised in a model validator to name the offending field (pydantic would name the model)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of those."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool = False
    logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_prompt_kind(cls, data: Any) -> Any:
        # a list mixing kinds (["hi", [5, 6]]) would get the union's error for one member only
        p = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(p, list) and len({type(x) for x in p}) > 1:
            kinds = sorted({type(x).__name__ for x in p})
            raise _FieldError(
                "prompt",
                "'prompt' must be a string, a list of token ids, a list of strings or a list of "
                f"token-id lists; this list mixes {', '.join(kinds)}",
            )
        return data


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; ``content`` is checked by the server (null allowed only for assistant).

    ``role`` is any non-empty string (``system``, ``user``, ``assistant``, ``tool``,
    ``developer`` or a role of the model's own chat template); keys beyond the declared ones are
    passed to the chat template as they are (as vLLM does: a template may read them).
    ``refusal``, ``audio`` and ``function_call`` are accepted only as null, ``annotations`` as
    null or ``[]``: what an assistant message of the ``openai`` client carries after
    ``.model_dump()`` (a reply sent back as history); a refusal, audio, a function call or
    annotations are not supported (400 ``unsupported_parameter`` naming the field).
    """

    model_config = ConfigDict(strict=True, extra="allow")
    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="before")
    @classmethod
    def _no_annotations(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("annotations") == []:
            return {k: v for k, v in data.items() if k != "annotations"}
        return data


class _ChatTemplateFields(_Strict):
    """How messages are rendered by the chat template (vLLM's chat extensions).

    Attributes:
        add_generation_prompt: end with the template's opening of an assistant turn.
        continue_final_message: end inside the last message (an assistant turn the model
            continues: prefill); needs ``add_generation_prompt: false``.
        chat_template_kwargs: extra variables for the template (Qwen3's ``enable_thinking``);
            each must be a variable the model's template uses.
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_fields(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise _FieldError(
                "continue_final_message",
                "'continue_final_message' needs 'add_generation_prompt': false (it continues "
                "the last message instead of opening a new assistant turn)",
            )
        return self


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    """A tool of ``tools``: ``{"type": "function", "function": {name, description,
    parameters}}`` (OpenAI)."""

    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """``POST /v1/chat/completions``.

    ``tools`` are rendered by the chat template; ``tool_choice`` ``"none"`` (the default
    without tools), ``"required"`` (the answer is a JSON array of ``{"name", "parameters"}``
    calls, guided by its schema, as vLLM) or a named function (the answer is that function's
    ``parameters`` object); ``"auto"`` needs a tool-call parser for the model's own format,
    which this server does not have (400, as vLLM without ``--enable-auto-tool-choice``).
    """

    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    logprobs: bool = False
    # vLLM: the answer starts with the last message's content when it has the answer's role
    echo: bool = False
    metadata: dict[str, str] | None = None  # OpenAI: tags for stored completions; no effect
    parallel_tool_calls: bool | None = None  # false: tool_choice 'required' makes one call
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.tool_choice not in (None, "none") and not self.tools:
            raise _FieldError("tool_choice", "'tool_choice' needs 'tools'")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in [t.function.name for t in self.tools or ()]:
                raise _FieldError(
                    "tool_choice.function.name", f"the tool '{name}' is not one of 'tools'"
                )
        if self.tool_choice == "auto" or (self.tools and self.tool_choice is None):
            raise _FieldError(
                "tool_choice",
                "'tool_choice' 'auto' (the default with 'tools') needs a tool-call parser, "
                "which this server does not have; send 'none', 'required' or a named function",
            )
        if self.tool_choice not in (None, "none") and (
            self.structured_outputs is not None or self.response_format not in (None,)
        ):
            raise _FieldError(
                "tool_choice",
                "use either a tool call ('tool_choice') or structured outputs, not both",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise _FieldError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise _FieldError(
                "max_tokens",
                f"'max_tokens' ({self.max_tokens}) and 'max_completion_tokens' "
                f"({self.max_completion_tokens}) disagree; send one of them",
            )
        return self


class TokenizeRequest(_ChatTemplateFields):
    """``POST /tokenize`` (vLLM): ``{"model", "prompt"}`` or ``{"model", "messages"}`` (with the
    chat template fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # vLLM: tool definitions for a template that renders them (with messages)
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise _FieldError("prompt", "give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM): ``{"model", "tokens"}``."""

    model: str | None = None
    tokens: list[StrictInt]


# ---- parsing -------------------------------------------------------------------------------
def _loc(loc: tuple) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("body",) or not isinstance(part, str):
            continue
        elif (
            "[" in part
            or part in ("str", "int", "float", "bool", "dict")
            or part.startswith(("function-", "constrained-"))
        ):
            continue  # pydantic's union-member labels
        else:
            out += ("." if out else "") + part
    return out or None


_TYPE_ERRORS = ("type", "parsing", "literal_error", "model_type", "dict_type", "list_type")

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: dict) -> M:
    """Validate ``body`` into ``model``.

    Raises:
        APIError: 400 naming the first offending field: code ``missing_required_parameter``,
            ``invalid_type``, ``unrecognized_parameter`` or ``invalid_value``.
    """
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        # a union reports one error per member: prefer the most specific (longest) location
        err = max(errs, key=lambda e: len(e.get("loc", ())))
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _FieldError):
            raise bad(str(ctx_err), ctx_err.param) from None
        param = _loc(tuple(err.get("loc", ())))
        kind = err.get("type", "")
        inp = err.get("input")
        if kind == "missing":
            raise bad(f"'{param}' is required", param, "missing_required_parameter") from None
        if kind == "none_required":  # a field accepted only as null (ChatMessage.refusal, ...)
            raise bad(
                f"'{param}' is not supported by this server (got {inp!r})"[:500],
                param,
                "unsupported_parameter",
            ) from None
        if kind == "extra_forbidden":
            raise bad(
                f"Unrecognized request argument supplied: {param}", param, "unrecognized_parameter"
            ) from None
        if kind == "finite_number" or (isinstance(inp, float) and not math.isfinite(inp)):
            raise bad(f"'{param}' must be a finite number, got {inp}", param) from None
        if any(t in kind for t in _TYPE_ERRORS):
            raise bad(
                f"'{param}': {err.get('msg')}, got {type(inp).__name__} {inp!r}"[:500],
                param,
                "invalid_type",
            ) from None
        # pydantic's error type too (greater_than_equal, ...), as vLLM's messages carry it
        raise bad(f"'{param}': {err.get('msg')} ({kind}), got {inp!r}"[:500], param) from None
