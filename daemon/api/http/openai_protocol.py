"""OpenAI wire formats as pydantic models: chat completions, completions, responses, models, errors.

Requests accept (and ignore) fields moed has no use for (``user``, ``metadata``, ``store``, ...),
as OpenAI-compatible servers do, so that clients written for OpenAI work unchanged; fields that
would change the output in a way moed cannot honour (``n`` > 1, ``logprobs``, ``echo``) are
refused by the serving modules with a 400. Responses are built as these models and dumped to
JSON; the shapes follow the ``openai`` SDK's types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    # unknown fields are accepted and ignored; known ones must have their JSON type ("yes" is no boolean)
    model_config = ConfigDict(extra="allow", strict=True)


# ---- errors ----

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- shared request parts ----

class FunctionSpec(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """Sampling fields common to chat completions and completions (ranges as OpenAI documents them)."""

    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # vLLM / llama-server extensions, used by some front ends
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float | int] | None = None  # token id (as a string) -> bias in [-100, 100]
    # llama-server's constrained decoding: a GBNF string (or {"type": "gbnf" | "lark" | "regex", "grammar"}) and a
    # JSON schema (api/http/structured_output.py)
    grammar: str | dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None


# ---- chat completions ----

class ToolCallFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier turn's reasoning, as this server returns it


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # text | json_object | json_schema (structured_output.py)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # with logprobs: true
    reasoning_effort: str | None = None  # passed to the chat template (gpt-oss reads it)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallDeltaFunction


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- completions ----

class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


class CompletionLogprobs(BaseModel):
    """The legacy completions' shape: parallel lists, alternatives as {token: logprob}."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# ---- models ----

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moed"
    # what llama-server / vLLM report (max_model_len), for agents that read it; None for a model on disk, which
    # a request loads on demand (its context is set then)
    context_length: int | None
    max_model_len: int | None
    loaded: bool = True


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- responses ----

class ResponsesTool(_Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[dict[str, Any]] | None = None  # a "namespace" tool's functions (Codex's multi-agent tools)


class ResponsesNamedTool(_Lenient):
    type: Literal["function"]
    name: str


class ResponsesReasoning(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Lenient):
    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)  # not in OpenAI's API; handy for tests
    reasoning: ResponsesReasoning | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    text: dict[str, Any] | None = None  # {"format": text | json_object | json_schema} (structured_output.py)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None  # "message.output_text.logprobs": the answer's token log-probabilities


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprobOut] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessageItem(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # a call to a function of a "namespace" tool
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessageItem | FunctionCallItem | ReasoningItem


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ErrorDetail | None = None
    usage: ResponsesUsage | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["auto", "disabled"] = "disabled"
