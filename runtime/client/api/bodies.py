"""Response bodies of the OpenAI-compatible API, as pydantic models (what ``/openapi.json``
documents and every answer is built from).

Shapes follow OpenAI's API reference and vLLM's server for its keys: every non-streamed
completion choice carries ``prompt_logprobs`` and ``prompt_token_ids`` (``null`` unless asked
for with ``prompt_logprobs`` / ``return_token_ids``), a chat completion carries them at the top
level; ``token_ids`` (the generated ids) is on every choice, ``null`` unless
``return_token_ids: true`` (as vLLM); ``stop_reason`` is the matched stop string or stop token id.

A prompt logprob row (:data:`PromptLogprobs`) is vLLM's: ``null`` for the first prompt token,
else ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token and the
``k`` most likely tokens (``rank`` 1 = most likely; ``null`` for a prompt token outside the top
``k``, whose rank the engine does not compute).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer: ``{"error": {message, type, param, code}}`` (OpenAI's shape)."""

    error: ErrorDetail


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: per prompt token: null (the first) or {token id (decimal string): its logprob entry}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogProbs(BaseModel):
    """Completions ``logprobs``: parallel lists, one entry per token (echoed prompt tokens
    first, the first of them ``null``)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    """``tool_calls``: with ``tool_choice`` ``"required"`` or named (``content`` is then
    ``""``), else ``[]`` (as vLLM)."""

    role: str = "assistant"
    content: str
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "eaas"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    """``GET /health``: the fields every client answers; the dispatcher's view adds more
    (``mode``, ``servers``, ``uncovered_experts``, ``kv_cache``, ...)."""

    model_config = ConfigDict(extra="allow")
    status: Literal["ok", "degraded"]
    model: str
    client_id: str
    running: int
    waiting: int
    routing_table_version: int | None = None
    uncovered_experts: Any = None
