"""Anthropic Messages API wire schemas (pydantic): requests parsed at the edge, responses, stream events, errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

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


class OtherBlock(BaseModel):
    """Any other block type (server-tool calls and results, search results, container uploads, what the
    API adds next): kept with all its fields, and shown to the model as a short text."""

    model_config = ConfigDict(extra="allow")
    type: str


def _tagged(*known: type[BaseModel]):
    """A union of block models chosen by "type", with OtherBlock for every type not among them."""
    tags = {model.model_fields["type"].annotation.__args__[0]: model for model in known}

    def tag_of(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return kind if kind in tags else "other"

    members = tuple(Annotated[model, Tag(tag)] for tag, model in tags.items()) + (Annotated[OtherBlock, Tag("other")],)
    return Annotated[Union[members], Discriminator(tag_of)]


ResultBlock = _tagged(TextBlock, ImageBlock, DocumentBlock)


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, list[ResultBlock], None] = None
    is_error: bool = False


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Wire):
    type: Literal["redacted_thinking"]
    data: str = ""


InputBlock = _tagged(TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                     RedactedThinkingBlock)


class InputMessage(_Wire):
    # "system" entries inside messages: Claude Code sends them (beta "mid-conversation-system-2026-04-07")
    role: Literal["user", "assistant", "system"]
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
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": ...}: enforced (structured_output.py)


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
    container: Any = None  # a code-execution container: refused (moed runs no tools)


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
