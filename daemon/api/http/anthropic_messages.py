"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the model's chat template.

Mapping onto the HF chat template (as llama-server and LiteLLM do): ``system`` (a string or text
blocks, joined by newlines) becomes a leading system message; a user turn's ``tool_result``
blocks become ``tool`` messages (``tool_call_id``, ``name`` of the call they answer, the result
text; ``is_error`` prefixes it with "Error: "), followed by one user message with its text
blocks; an assistant turn becomes one assistant message with its text as ``content``, its
``thinking`` as ``reasoning_content`` (templates that show earlier reasoning use it, others drop
it) and its ``tool_use`` blocks as ``tool_calls``. Consecutive user turns are merged, as the
API does. ``tools`` are rendered through the template's ``tools`` variable as OpenAI-style
function schemas. A conversation that ends with an assistant turn is a prefill: the answer
continues that text.

tool_choice: "auto" (or absent) and "any" render every tool, "tool" renders only the named one,
"none" renders none and parses no calls; "any" and "tool" are enforced by a grammar of calls where moed
has one for the model's tool syntax (text/tool_grammar.py), and ``output_config.format`` by its JSON
schema (structured_output.py). ``thinking`` config sets the template's ``enable_thinking`` (Qwen3-style
templates); reasoning in the output (whatever the config) comes back as thinking blocks.

The stream is Anthropic's event sequence: message_start, then per content block (in order,
each closed before the next opens) content_block_start / content_block_delta (text_delta,
thinking_delta then one signature_delta, input_json_delta) / content_block_stop, then
message_delta (stop_reason, stop_sequence, cumulative usage: output, input and cache-read tokens)
and message_stop; ``ping`` whenever
the model has been silent for ``PING_INTERVAL_S`` (a long prefill). The non-streamed answer is
built by the same block builder, so both always agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from moed.api.http.anthropic_protocol import (ERROR_STATUS, CountTokensRequest, CountTokensResponse,
                                              ErrorDetail, ErrorResponse, InputMessage, MessageResponse,
                                              MessagesRequest, TextOut, ThinkingOut, ToolUseOut,
                                              Usage)
from moed.api.http.bridge import EngineBridge, GenerationStream
from moed.api.http.chat_request import ChatRequest, media_placeholder
from moed.api.http.error_status import HttpFailure, ParamError, failure_of, refuse_fields, validation_failure
from moed.api.http.output_stream import Finished, parsed_events
from moed.api.http.sse_response import SseResponse
from moed.api.http.structured_output import anthropic_grammar
from moed.engine.sampling import SamplingParams
from moed.errors import ServiceUnavailableError

ERROR_PATH_PREFIX = "/v1/messages"  # app.py renders every error under it with anthropic_error_response
PING_INTERVAL_S = 5.0  # a ping event when the model has been silent this long (read per request)
DISCONNECT_POLL_S = 0.5  # non-streamed requests: how often to check that the client is still there
DEFAULT_TEMPERATURE = 1.0  # Anthropic's default when a request omits temperature

# HttpFailure.kind -> Anthropic's error type; the status follows the type (ERROR_STATUS), except that
# "unavailable" (paused, loading, stopping) keeps 503: the daemon is not busy, it is not serving yet
ERROR_TYPES = {"invalid_request": "invalid_request_error", "authentication": "authentication_error",
               "not_found": "not_found_error", "rate_limit": "overloaded_error", "unavailable": "overloaded_error",
               "internal": "api_error"}
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "context": "max_tokens",
                "deadline": "max_tokens", "cancelled": "end_turn"}


# ---- errors -----------------------------------------------------------------------------------

def error_body(failure: HttpFailure) -> dict[str, Any]:
    kind = ERROR_TYPES.get(failure.kind, "api_error")
    return ErrorResponse(error=ErrorDetail(type=kind, message=failure.message)).model_dump()


def anthropic_error_response(failure: HttpFailure) -> Response:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    body = error_body(failure)
    status = 503 if failure.kind == "unavailable" else ERROR_STATUS[body["error"]["type"]]
    headers = {"Retry-After": str(failure.retry_after)} if status in (429, 503, 529) else None
    return JSONResponse(body, status_code=status, headers=headers)


_BRANCH = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|tagged-union\[.*\])$")


def _clean_problems(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pydantic's errors without union-branch noise: the ``str`` / ``list[...]`` branch labels and the
    block tags leave the location; the string branch's complaint about a list is dropped (the list
    branch says what is wrong in it); neither-string-nor-list becomes one message."""
    out, seen = [], set()
    for p in problems:
        loc, branch, skip_tag = [], None, False
        for part in p.get("loc", ()):
            if skip_tag and isinstance(part, str):  # a tagged union's tag (the block's "type")
                skip_tag = False
                continue
            if isinstance(part, str) and _BRANCH.match(part):
                branch, skip_tag = part, "tagged-union" in part
                continue
            loc.append(part)
        value = p.get("input")
        if branch is not None and p.get("type") in ("string_type", "list_type"):
            if isinstance(value, list) and p["type"] == "string_type":
                continue
            if not isinstance(value, (str, list)):
                p = {**p, "msg": "must be a string or a list of content blocks"}
        key = (tuple(loc), p.get("msg"))
        if key not in seen:
            seen.add(key)
            out.append({**p, "loc": tuple(loc)})
    return out


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """The request body as ``model``, or a 400 naming the first few fields at fault."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as exc:
        failure = validation_failure(_clean_problems(list(exc.errors())))
        raise ParamError(failure.message, failure.param) from None


# ---- request -> ChatRequest --------------------------------------------------------------------

BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's per-request attribution block (see _system_text)


class _Media:
    """Counts the image / document blocks replaced by placeholder text (for the log)."""

    def __init__(self) -> None:
        self.dropped = 0

    def placeholder(self, block: Any) -> str:
        self.dropped += 1
        source = getattr(block, "source", None) or {}
        detail = source.get("media_type") or source.get("type") or "" if isinstance(source, dict) else ""
        return media_placeholder(block.type, str(detail))


def _other_text(block: Any) -> str:
    """A block of a type the model has no syntax for (server-tool calls and results, search results, ...)
    as text: its own text when it has some, else a short note naming its type."""
    text = getattr(block, "text", None)
    if isinstance(text, str) and text:
        return text
    content = getattr(block, "content", None)
    if isinstance(content, str) and content:
        return content
    if isinstance(content, list):
        texts = [c.get("text") for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
        if texts:
            return "\n".join(texts)
    name = getattr(block, "name", None)
    return f"[{block.type}{' ' + name if isinstance(name, str) else ''} block]"


def _text_of(blocks: str | list[Any] | None, media: _Media) -> str:
    """Blocks as one text: text blocks joined by newlines, images and documents as placeholders."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for block in blocks:
        if block.type == "text":
            texts.append(block.text)
        elif block.type in ("image", "document"):
            texts.append(media.placeholder(block))
        else:
            texts.append(_other_text(block))
    return "\n".join(texts)


def _system_text(system: str | list[Any] | None, media: _Media) -> str:
    """The system prompt, without Claude Code's billing-header block: ``x-anthropic-billing-header:
    cc_version=...; cch=...;`` changes with every request, so leaving it first in the prompt would
    make no two requests share a prefix (gateways strip it too)."""
    if isinstance(system, list):
        system = [b for b in system if not (b.type == "text" and b.text.lstrip().startswith(BILLING_HEADER))]
    elif isinstance(system, str) and system.lstrip().startswith(BILLING_HEADER):
        system = system.split("\n", 1)[1] if "\n" in system else ""
    return _text_of(system, media)


def template_messages(body: CountTokensRequest, media: _Media | None = None) -> list[dict[str, Any]]:
    """Anthropic system + messages -> HF-style chat messages (see the module docstring)."""
    media = media or _Media()
    if not body.messages:
        raise ParamError("messages is empty; send at least one {'role': 'user', 'content': ...} message", "messages")
    out: list[dict[str, Any]] = []
    system = _system_text(body.system, media)
    if system:
        out.append({"role": "system", "content": system})
    call_names: dict[str, str] = {}  # tool_use id -> tool name, from earlier assistant turns
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        if message.role == "assistant":
            out.append(_assistant_message(message, media, call_names))
            continue
        if message.role == "system":  # folded into the user turns by the chat request rules
            out.append({"role": "system", "content": _text_of(message.content, media)})
            continue
        for msg in _user_messages(message, where, media, call_names):
            last = out[-1] if out else None
            if msg["role"] == "user" and last is not None and last["role"] == "user":
                last["content"] = f"{last['content']}\n\n{msg['content']}"  # the API merges consecutive user turns
            else:
                out.append(msg)
    return out


def _assistant_message(message: InputMessage, media: _Media, call_names: dict[str, str]) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, reasoning, calls = [], [], []
    for block in message.content:
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "thinking":
            reasoning.append(block.thinking)
        elif block.type == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif block.type == "tool_use":
            call_names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif block.type in ("image", "document"):
            texts.append(media.placeholder(block))
        else:
            texts.append(_other_text(block))
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user_messages(message: InputMessage, where: str, media: _Media,
                   call_names: dict[str, str]) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    tools, texts = [], []
    for j, block in enumerate(message.content):
        if block.type == "tool_result":
            if block.tool_use_id not in call_names:
                raise ParamError(f"{where}[{j}] is a tool_result for tool_use_id {block.tool_use_id!r}, but no earlier "
                                 "assistant turn has a tool_use block with that id", f"{where}[{j}].tool_use_id")
            result = _text_of(block.content, media)
            if block.is_error and not result.startswith("Error"):
                result = f"Error: {result}"
            # tool results go first, right after the assistant turn that called the tools, as templates expect
            tools.append({"role": "tool", "tool_call_id": block.tool_use_id, "name": call_names[block.tool_use_id],
                          "content": result})
        elif block.type in ("tool_use", "thinking", "redacted_thinking"):
            raise ParamError(f"{where}[{j}] is a {block.type!r} block, which only an assistant turn can hold; a "
                             "user turn holds text, tool_result, image and document blocks", f"{where}[{j}]")
        else:
            texts.append(_text_of([block], media))
    if texts or not tools:
        tools.append({"role": "user", "content": "\n".join(texts)})
    return tools


def template_tools(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The tools to render (OpenAI-style function schemas), after tool_choice."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice.type in ("any", "tool"):
            raise ParamError(f"tool_choice {choice.type!r} needs tools, but the request has none", "tool_choice")
        return []
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.input_schema is None:
            raise ParamError(f"tools[{i}] ({tool.name!r}, type {tool.type!r}) has no input_schema: moed runs only "
                             "client tools, not Anthropic's server tools (web search, code execution, ...)",
                             f"tools[{i}].input_schema")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    if choice is None or choice.type in ("auto", "any"):
        return tools
    if choice.type == "none":
        return []
    if not choice.name:
        raise ParamError("tool_choice {'type': 'tool'} needs the 'name' of the tool to use", "tool_choice.name")
    named = [t for t in tools if t["function"]["name"] == choice.name]
    if not named:
        names = ", ".join(t["function"]["name"] for t in tools)
        raise ParamError(f"tool_choice names tool {choice.name!r}, which is not among the request's tools ({names})",
                         "tool_choice.name")
    return named


def template_variables(body: CountTokensRequest) -> dict[str, Any]:
    """Chat-template variables from the thinking config (Qwen3's ``enable_thinking``) and
    ``output_config.effort`` (gpt-oss's ``reasoning_effort``); absent fields keep the template's default."""
    variables: dict[str, Any] = {}
    if body.thinking is not None:
        variables["enable_thinking"] = body.thinking.type != "disabled"
    effort = body.output_config.effort if body.output_config is not None else None
    if effort:
        variables["reasoning_effort"] = effort if effort in ("low", "medium", "high") else "high"
    return variables


def chat_request(body: CountTokensRequest) -> ChatRequest:
    """The request as moed's one internal chat request (count_tokens counts exactly its prompt)."""
    media = _Media()
    messages = template_messages(body, media)
    last = messages[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"])
    options: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        options = {"params": sampling_params(body), "max_tokens": body.max_tokens, "stream": body.stream}
    choice = body.tool_choice
    forced = choice is not None and choice.type in ("any", "tool") and bool(body.tools)
    thinking = body.thinking
    budget = thinking.budget_tokens if thinking is not None and thinking.type == "enabled" else None
    return ChatRequest(messages, template_tools(body), template_variables(body), prefill=prefill,
                       reasoning_budget=budget,
                       forced_tools=forced and not prefill,
                       parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
                       dropped_media=media.dropped, **options)


def sampling_params(body: MessagesRequest) -> SamplingParams:
    return SamplingParams(
        grammar=anthropic_grammar(body.output_config),
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        max_tokens=body.max_tokens,
        stop=tuple(body.stop_sequences or ()),
    )


# ---- output events -> content blocks ----------------------------------------------------------

Event = tuple[str, dict[str, Any]]  # (SSE event name, its JSON payload)


def _signature(thinking: str) -> str:
    # Anthropic signs thinking so it can be sent back; moed ignores returned signatures, but clients
    # expect a non-empty one
    return "moed-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


class BlockBuilder:
    """Parser OutputEvents -> Anthropic content blocks and the stream events that build them.

    Blocks are opened in output order and each is closed before the next opens. Whitespace at the
    end of a text block is held back until more text comes: it is dropped when a thinking or
    tool_use block follows (the "\\n\\n" before a ``<tool_call>``), kept when the answer ends.
    With ``single_tool`` (disable_parallel_tool_use) calls after the first are dropped; without
    ``show_thinking`` (thinking display "omitted") reasoning is left out.
    """

    def __init__(self, *, single_tool: bool = False, show_thinking: bool = True) -> None:
        self.blocks: list[TextOut | ThinkingOut | ToolUseOut] = []
        self._open: str | None = None  # "text" | "thinking" | "tool_use"
        self._open_tool: int | None = None  # the parser's tool_index of the open tool_use block
        self._held = ""  # trailing whitespace of the text so far
        self._arguments: dict[int, str] = {}  # block index -> the arguments JSON text
        self._single_tool = single_tool
        self._show_thinking = show_thinking
        self._tools_seen: list[int] = []

    @property
    def has_tool_use(self) -> bool:
        return any(b.type == "tool_use" for b in self.blocks)

    def add(self, event: Any) -> list[Event]:
        if event.kind == "text":
            return self._text(event.text or "")
        if event.kind == "reasoning":
            if not event.text or not self._show_thinking:
                return []
            out = self._open_block("thinking", ThinkingOut()) if self._open != "thinking" else []
            self.blocks[-1].thinking += event.text
            return out + [self._delta({"type": "thinking_delta", "thinking": event.text})]
        if event.kind == "tool_call":
            return self._tool_call(event)
        return []

    def finish(self) -> list[Event]:
        """Close the open block (held whitespace goes out when the answer ends in text)."""
        out = []
        if self._held and (self._open == "text" or not self.blocks):
            held, self._held = self._held, ""
            out += self._emit_text(held)
        return out + self._close()

    def _text(self, text: str) -> list[Event]:
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return self._emit_text(body) if body else []

    def _emit_text(self, text: str) -> list[Event]:
        out = self._open_block("text", TextOut()) if self._open != "text" else []
        self.blocks[-1].text += text
        return out + [self._delta({"type": "text_delta", "text": text})]

    def _tool_call(self, event: Any) -> list[Event]:
        index = event.tool_index
        if index not in self._tools_seen:
            self._tools_seen.append(index)
        if self._single_tool and index != self._tools_seen[0]:
            return []
        out: list[Event] = []
        if self._open != "tool_use" or self._open_tool != index:
            block = ToolUseOut(id=f"toolu_{uuid.uuid4().hex[:24]}", name=getattr(event, "name", None) or "")
            self._held = ""  # whitespace before a call is not part of the answer
            out += self._open_block("tool_use", block)
            self._open_tool = index
        elif getattr(event, "name", None) and not self.blocks[-1].name:
            self.blocks[-1].name = event.name
        piece = getattr(event, "arguments_delta", None) or ""
        if piece:
            n = len(self.blocks) - 1
            self._arguments[n] = self._arguments.get(n, "") + piece
            out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        return out

    def _open_block(self, kind: str, block: Any) -> list[Event]:
        out = self._close()
        if kind != "text":
            self._held = ""
        self.blocks.append(block)
        self._open = kind
        start = block.model_dump()
        if kind == "tool_use":
            start["input"] = {}
        return out + [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                               "content_block": start})]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        index, block = len(self.blocks) - 1, self.blocks[-1]
        out: list[Event] = []
        if self._open == "thinking":
            block.signature = _signature(block.thinking)
            out.append(self._delta({"type": "signature_delta", "signature": block.signature}))
        elif self._open == "tool_use":
            block.input = _arguments_object(self._arguments.get(index, ""))
        self._open, self._open_tool = None, None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": index})]


def _arguments_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# ---- the endpoints ----------------------------------------------------------------------------

class _TokenRecorder:
    """The stream seen through ``parsed_events``, remembering every generated token id."""

    def __init__(self, stream: GenerationStream) -> None:
        self._stream = stream
        self.token_ids: list[int] = []

    async def events(self, **kwargs: Any) -> AsyncIterator[Any]:
        async with contextlib.aclosing(self._stream.events(**kwargs)) as events:
            async for event in events:
                if event is not None:
                    self.token_ids.extend(event.token_ids)
                yield event


def _matched_stop(stops: tuple[str, ...], text: str) -> str | None:
    """The stop sequence that ended ``text`` (the output with it): the one completed first, as StopMatcher rules."""
    if len(stops) == 1:
        return stops[0]
    hits = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(hits)[2] if hits else None


class _Answer:
    """One request's generation: the parsed events and what the final message_delta needs."""

    def __init__(self, bridge: EngineBridge, entry: Any, body: MessagesRequest) -> None:
        self.bridge, self.entry, self.body = bridge, entry, body
        prepared = bridge.prepare_chat(entry, chat_request(body))
        self.prompt_ids, self.params, self.parser = prepared.prompt_ids, prepared.params, prepared.parser
        self.raw = True
        self.stream = prepared.stream
        self.recorder = _TokenRecorder(self.stream)
        self.builder = BlockBuilder(
            single_tool=bool(body.tool_choice and body.tool_choice.disable_parallel_tool_use),
            show_thinking=not (body.thinking is not None and body.thinking.display == "omitted"))
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    def events(self, **kwargs: Any) -> AsyncIterator[Any]:
        return parsed_events(self.recorder, self.parser, **kwargs)

    def cancel(self) -> None:
        self.stream.cancel()

    def stop(self, finished: Finished) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) for the engine's finish reason."""
        if finished.reason == "error":
            raise RuntimeError(f"generation failed: {finished.error}")
        reason = STOP_REASONS.get(finished.reason, "end_turn")
        if reason == "max_tokens":
            return reason, None
        if self.builder.has_tool_use:
            return "tool_use", None
        if reason == "stop_sequence":
            text = self.bridge.tokenizer(self.entry).decode(self.recorder.token_ids, skip_special_tokens=not self.raw)
            return reason, _matched_stop(self.params.stop, text)
        return reason, None

    def usage(self, finished: Finished | None) -> Usage:
        u = finished.usage if finished is not None else None
        cached = u.cached_tokens if u is not None else 0
        # Anthropic counts input read from the cache apart: input_tokens + cache_read_input_tokens = the prompt
        return Usage(input_tokens=len(self.prompt_ids) - cached, output_tokens=u.completion_tokens if u is not None else 0,
                     cache_read_input_tokens=cached)

    def message(self, content: list[Any], finished: Finished | None = None, stop: tuple[str | None, str | None] = (
            None, None)) -> MessageResponse:
        return MessageResponse(id=self.id, model=self.entry.name, content=content, stop_reason=stop[0],
                               stop_sequence=stop[1], usage=self.usage(finished))


def _sse(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def create_message(bridge: EngineBridge, body: MessagesRequest, request: Request) -> Response:
    refuse_fields(body, {"container": "moed runs no code-execution containers"})
    entry = await bridge.acquire(body.model)
    answer = _Answer(bridge, entry, body)
    if body.stream:
        return SseResponse(_stream_events(answer), answer.cancel)
    finished = None
    async for event in answer.events(heartbeat_s=DISCONNECT_POLL_S, is_disconnected=request.is_disconnected):
        if isinstance(event, Finished):
            finished = event
        elif event is not None:
            answer.builder.add(event)
    if finished is None:  # the client left; nobody reads this
        return JSONResponse({}, status_code=499)
    _raise_if_cancelled(finished)
    answer.builder.finish()
    stop = answer.stop(finished)
    return JSONResponse(answer.message(answer.builder.blocks, finished, stop).model_dump())


async def _stream_events(answer: _Answer) -> AsyncIterator[str]:
    yield _sse("message_start", {"type": "message_start", "message": answer.message([]).model_dump()})
    try:
        async for event in answer.events(heartbeat_s=PING_INTERVAL_S):
            if event is None:
                yield _sse("ping", {"type": "ping"})
            elif not isinstance(event, Finished):
                for name, payload in answer.builder.add(event):
                    yield _sse(name, payload)
            else:
                _raise_if_cancelled(event)
                closing = answer.builder.finish()
                stop_reason, stop_sequence = answer.stop(event)
                for name, payload in closing:
                    yield _sse(name, payload)
                yield _sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                             # cumulative totals: the prefix cache's share is known only now
                                             "usage": answer.usage(event).model_dump(
                                                 include={"input_tokens", "output_tokens",
                                                          "cache_read_input_tokens"})})
                yield _sse("message_stop", {"type": "message_stop"})
    except Exception as exc:  # the status line is long gone: report it in the stream, as Anthropic does
        yield _sse("error", error_body(failure_of(exc)))


def _raise_if_cancelled(finished: Finished) -> None:
    if finished.reason == "cancelled":
        raise ServiceUnavailableError("the request was cancelled before it finished (the daemon is stopping or the "
                                      "model was unloaded)")


def anthropic_router(bridge: EngineBridge) -> APIRouter:
    """The Anthropic endpoints; errors under ERROR_PATH_PREFIX are rendered by anthropic_error_response."""
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await create_message(bridge, parse_body(MessagesRequest, await request.body()), request)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        body = parse_body(CountTokensRequest, await request.body())
        prompt_ids, _ = bridge.chat_prompt(await bridge.acquire(body.model), chat_request(body))
        return JSONResponse(CountTokensResponse(input_tokens=len(prompt_ids)).model_dump())

    return router
