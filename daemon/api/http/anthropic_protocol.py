"""Anthropic Messages API wire schemas (pydantic): requests parsed at the edge, responses, stream events, errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# ---- request ----------------------------------------------------------------------------------


class _Wire(BaseModel):
    # Clients send fields moed has no use for (cache_control, citations, new API features); a
    # translation layer ignores them rather than refusing the request.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ImageBlock(_Wire):
    type: Literal["image"]
    source: dict[str, Any] = Field(default_factory=dict)


class DocumentBlock(_Wire):
    type: Literal["document"]
    source: dict[str, Any] = Field(default_factory=dict)


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, list[Annotated[Union[TextBlock, ImageBlock, DocumentBlock], Field(discriminator="type")]],
                   None] = None
    is_error: bool = False


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Wire):
    type: Literal["redacted_thinking"]
    data: str = ""


InputBlock = Annotated[
    Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
    Field(discriminator="type"),
]


class InputMessage(_Wire):
    role: Literal["user", "assistant"]
    content: Union[str, list[InputBlock]]


class Tool(_Wire):
    type: str | None = None  # "custom" or absent; server tools (web_search_...) have other types
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Wire):
    type: str  # "enabled" | "adaptive" | "between_tools" | "disabled" | what the API adds next
    budget_tokens: int | None = None
    display: str | None = None  # "summarized" | "omitted" (thinking text left out of the answer)


class OutputConfig(_Wire):
    effort: str | None = None  # "low" | "medium" | "high" | "xhigh" | "max"


class CountTokensRequest(_Wire):
    """POST /v1/messages/count_tokens: everything that shapes the prompt."""

    model: str
    messages: list[InputMessage]
    system: Union[str, list[TextBlock], None] = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False


# ---- response ---------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str = ""


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    signature: str = ""


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


OutputBlock = Union[ThinkingOut, TextOut, ToolUseOut]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock] = Field(default_factory=list)
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---- errors -----------------------------------------------------------------------------------

ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                    "request_too_large", "rate_limit_error", "api_error", "overloaded_error"]

# the HTTP status Anthropic sends with each error type
ERROR_STATUS: dict[str, int] = {
    "invalid_request_error": 400, "authentication_error": 401, "permission_error": 403, "not_found_error": 404,
    "request_too_large": 413, "rate_limit_error": 429, "api_error": 500, "overloaded_error": 529,
}


class ErrorDetail(BaseModel):
    type: ErrorType
    message: str


class ErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorDetail
