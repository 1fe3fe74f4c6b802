"""OpenAI HTTP API models shared by the cloud runtime, the edge runtime and the gateway.

Every hop of the request path speaks this dialect, so every part can be tested alone with
the real ``openai`` client. Requests accept unknown fields (``extra="allow"``): a gateway
forwards what it does not understand, and a runtime ignores it. Responses are strict.

Errors have one shape everywhere, ``{"error": {"message", "type", "param", "code"}}``, and
the ``code`` values below are stable: clients and the gateway branch on them. The HTTP
status that goes with each code is in :data:`ERROR_STATUS`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

# --- stable error codes -----------------------------------------------------------------

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_PARAMETER = "invalid_parameter"
INVALID_REQUEST = "invalid_request"
MODEL_NOT_FOUND = "model_not_found"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
SERVER_OVERLOADED = "server_overloaded"
MODEL_NOT_READY = "model_not_ready"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
UNAUTHORIZED = "unauthorized"
CONTENT_FILTERED = "content_filtered"
UPSTREAM_UNAVAILABLE = "upstream_unavailable"
TIER_UNREACHABLE = "tier_unreachable"  # a tier across a WAN that its probes cannot reach
INTERNAL_ERROR = "internal_error"

ERROR_STATUS: dict[str, int] = {
    CONTEXT_LENGTH_EXCEEDED: 400,
    INVALID_PARAMETER: 400,
    INVALID_REQUEST: 400,
    CONTENT_FILTERED: 400,
    UNAUTHORIZED: 401,
    MODEL_NOT_FOUND: 404,
    NOT_FOUND: 404,
    METHOD_NOT_ALLOWED: 405,
    RATE_LIMIT_EXCEEDED: 429,
    INTERNAL_ERROR: 500,
    UPSTREAM_UNAVAILABLE: 502,
    SERVER_OVERLOADED: 503,
    MODEL_NOT_READY: 503,
    TIER_UNREACHABLE: 503,
}

ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def make_error(code: str, message: str, param: str | None = None) -> tuple[int, ErrorResponse]:
    """The HTTP status and body for one of the stable codes."""
    status = ERROR_STATUS.get(code, 500)
    detail = ErrorDetail(
        message=message, type=ERROR_TYPE.get(status, "server_error"), param=param, code=code
    )
    return status, ErrorResponse(error=detail)


class APIError(Exception):
    """An error a server answers with: one of the stable codes, the message, the parameter.

    Raised anywhere in a request's handling; each server (cloud, edge, gateway) renders it
    with :func:`make_error` in its own web framework.
    """

    def __init__(
        self,
        code: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.headers = code, message, param, headers


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --- requests ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = Field(default=False, strict=True)


class StopField(BaseModel):
    """OpenAI's ``stop``: a string or up to 4 non-empty strings (the sampling endpoints and
    the cloud runtime's /v1/search)."""

    stop: str | list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        if isinstance(v, list) and any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class _SamplingFields(StopField):
    """Fields common to both endpoints, validated the same way everywhere."""

    model_config = ConfigDict(extra="allow")

    # Types are strict (JSON's own types, as OpenAI's API takes them): "false" is no
    # boolean and "100" or 100.0 no token count. A lax parse let a gateway and a runtime
    # read one field two ways (the gateway's limits saw a string, the runtime a number).
    model: str = Field(default="", strict=True)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, strict=True)
    n: int = Field(default=1, ge=1, le=16, strict=True)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, strict=True)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, strict=True)
    user: str | None = Field(default=None, strict=True)
    # Extensions (vLLM names): top_k <= 0 means off.
    top_k: int | None = Field(default=None, strict=True)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = Field(default=False, strict=True)
    # hybridllm extension: "interactive" (default) or "batch" scheduling class.
    priority: Literal["interactive", "batch"] = "interactive"
    # Extension (vLLM's name): prefix-cache partition. Requests share cached KV blocks (and
    # edge cached answers) only with requests of the same salt; the gateway sets it to the
    # tenant (the API key's name) when keys are configured, overriding the client's.
    cache_salt: str | None = Field(default=None, max_length=256)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def generation_cap(self, default_max_tokens: int) -> int:
        """The most tokens a runtime may generate for this request: ``max_tokens`` (else
        ``default_max_tokens``, the most any answer may hold) for each candidate, of
        which there are ``n``, or ``best_of`` when a runtime samples more and keeps the
        best (an extension field, so read from the extras)."""
        best_of = (self.model_extra or {}).get("best_of")
        width = self.n
        if isinstance(best_of, int) and not isinstance(best_of, bool):
            width = max(width, best_of)
        return (self.effective_max_tokens() or default_max_tokens) * width


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(
        cls, v: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        """Content parts other than text (``image_url``, ``input_audio``, ``file``) are
        refused by name: the models served here read text only, and a part dropped in
        silence would be an answer to a question the client did not ask."""
        for part in v if isinstance(v, list) else ():
            kind = part.get("type")
            if kind != "text":
                raise ValueError(
                    f"content part type {str(kind)[:40]!r} is not supported: the served "
                    "model reads text only (send parts of type 'text')"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError("a 'text' content part needs a string 'text'")
        return v

    def text(self) -> str:
        """Content as plain text (text parts of a multi-part message are concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = Field(default=False, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    echo: bool = Field(default=False, strict=True)
    suffix: str | None = None


# --- responses --------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    # hybridllm extension: mean log-probability of the completion tokens under the model's
    # own distribution, a confidence signal for edge-to-cloud escalation (None: not computed).
    mean_logprob: float | None = None


FinishReason = Literal["stop", "length", "abort", "content_filter", "tool_calls"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallDelta(ToolCall):
    index: int


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs shape (parallel lists)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """Also the shape of a completions stream chunk (OpenAI reuses it)."""

    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hybridllm"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def validation_error_param(loc: tuple[int | str, ...]) -> str | None:
    """The parameter a pydantic error location names: ``("body", "top_p")`` -> ``top_p``."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    if not parts:
        return None
    # model_validator errors carry no field; keep the dotted path of the rest.
    return ".".join(parts)
