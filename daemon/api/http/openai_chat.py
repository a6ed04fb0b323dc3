"""POST /v1/chat/completions: OpenAI chat messages -> the model's chat template -> the engine, and back.

tool_choice: "auto" (or absent) renders the request's tools and parses tool calls; "none" renders
no tools and parses none; a named function renders only that tool; "required" renders the tools
as "auto" does. The last two are enforced by a grammar of calls in the model's tool syntax where moed
has one (text/tool_grammar.py, applied in bridge.force_tool_calls); elsewhere the model is asked, not
forced. ``reasoning_effort`` "none" / "minimal" turns the template's thinking off (``enable_thinking``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from moed.api.http.bridge import EngineBridge, PreparedChat
from moed.api.http.chat_request import ChatRequest, media_placeholder
from moed.api.http.choice_streams import interleave
from moed.api.http.error_status import ParamError, failure_of
from moed.api.http.openai_protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                           ChatCompletionChunk, ChatCompletionRequest, ChatDelta, ChatMessage,
                                           ToolCallDelta, ToolCallDeltaFunction, ToolCallFunction, ToolCallOut)
from moed.api.http.openai_shared import (HEARTBEAT_S, SSE_DONE, SSE_KEEPALIVE, chat_logprobs, error_body,
                                         choices_usage, finish_reason, new_id, now, raise_if_failed,
                                         refuse_unsupported, sampling_params, sse, stop_strings, usage_of)
from moed.api.http.output_stream import Finished, Logprobs, OutputCollector, parsed_events
from moed.api.http.sse_response import SseResponse
from moed.api.http.structured_output import openai_chat_grammar
from moed.text.chat_template import validate_messages

TEXT_PART_TYPES = ("text", "input_text", "output_text")


MEDIA_PART_TYPES = ("image_url", "input_image", "input_audio", "file", "input_file")


def content_text(content: str | list[dict[str, Any]] | None, where: str, dropped: list[int] | None = None) -> str | None:
    """A message's content as one string (text parts joined by newlines); None stays None.

    Image, audio and file parts become a placeholder text (counted in ``dropped[0]``): moed's models
    read text only, and an agent's session must not end on a screenshot."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type", "text")
        if kind in MEDIA_PART_TYPES:
            if dropped is not None:
                dropped[0] += 1
            texts.append(media_placeholder(kind.removeprefix("input_").replace("_url", "")))
            continue
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise ParamError(f"{where}.content[{j}] is a {kind!r} part; moed serves text models, so only text "
                             "parts (and images or files, shown to the model as a placeholder) are accepted",
                             f"{where}.content")
        texts.append(part["text"])
    return "\n".join(texts)


def arguments_value(arguments: str | dict[str, Any]) -> Any:
    """Tool-call arguments as the chat template expects them: a JSON object when they parse as one."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments  # templates that print arguments as a string still work
    return value if isinstance(value, dict) else arguments


def template_messages(messages: list[ChatMessage], dropped: list[int] | None = None) -> list[dict[str, Any]]:
    """OpenAI messages -> the HF-style dicts chat templates read; tool results must answer a tool call."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # tool_call id -> function name, from earlier assistant messages
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        content = content_text(m.content, where, dropped)
        if content is not None:
            msg["content"] = content
        if m.role == "assistant":
            # a call-only turn comes with content null or none at all; templates read it as text (Qwen3's
            # slices every message's content), so it is "" there
            msg.setdefault("content", "")
            if m.tool_calls:
                msg["tool_calls"] = []
                for call in m.tool_calls:
                    call_names[call.id] = call.function.name
                    msg["tool_calls"].append({"id": call.id, "type": "function", "function": {
                        "name": call.function.name, "arguments": arguments_value(call.function.arguments)}})
            if m.reasoning_content:
                msg["reasoning_content"] = m.reasoning_content
        elif m.role == "tool":
            if not m.tool_call_id:
                raise ParamError(f"{where} (tool) has no 'tool_call_id'; give the id of the assistant tool call it "
                                 "answers", f"{where}.tool_call_id")
            if m.tool_call_id not in call_names:
                raise ParamError(f"{where} (tool) answers tool call {m.tool_call_id!r}, but no earlier assistant "
                                 "message has a tool call with that id", f"{where}.tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
            msg["name"] = m.name or call_names[m.tool_call_id]
            msg.setdefault("content", "")
        elif content is None:
            raise ParamError(f"{where} ({m.role}) has no 'content'; give a string (it may be empty)",
                             f"{where}.content")
        out.append(msg)
    return validate_messages(out)


def request_tools(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools to render, after tool_choice: [] for "none" (or no tools), only the named one if named."""
    if not body.tools or body.tool_choice == "none":
        return []
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        named = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not named:
            names = ", ".join(t["function"]["name"] for t in tools)
            raise ParamError(f"tool_choice names function {choice.function.name!r}, which is not among the "
                             f"request's tools ({names})", "tool_choice")
        return named
    return tools


NO_REASONING_EFFORTS = ("none", "minimal")


def effort_variables(effort: str | None) -> dict[str, Any]:
    """Template variables of an OpenAI reasoning effort: ``reasoning_effort`` itself (gpt-oss, DeepSeek-V4 read it),
    and for "none" / "minimal" ``enable_thinking: false`` (Qwen3's and GLM's switch; DeepSeek's templates too)."""
    if effort is None:
        return {}
    variables: dict[str, Any] = {"reasoning_effort": effort}
    if effort in NO_REASONING_EFFORTS:
        variables["enable_thinking"] = False
    return variables


def chat_request(body: ChatCompletionRequest) -> ChatRequest:
    """The request as moed's one internal chat request."""
    dropped = [0]
    messages = template_messages(body.messages, dropped)
    variables = {**effort_variables(body.reasoning_effort), **(body.chat_template_kwargs or {})}
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, max_tokens=max_tokens or 1, stop=stop_strings(body.stop),
                             grammar=openai_chat_grammar(body))
    forced = body.tool_choice == "required" or (body.tool_choice is not None and not isinstance(body.tool_choice, str))
    return ChatRequest(messages, request_tools(body), variables, params, max_tokens=max_tokens, stream=body.stream,
                       forced_tools=forced and bool(body.tools), parallel_tool_calls=body.parallel_tool_calls is not False,
                       dropped_media=dropped[0])


async def create_chat_completion(bridge: EngineBridge, body: ChatCompletionRequest, request: Request):
    refuse_unsupported(body)
    entry = await bridge.acquire(body.model)
    chat = chat_request(body)
    prepared = bridge.prepare_chat(entry, chat)
    parser, stream = prepared.parser, prepared.stream
    chat_id, created = new_id("chatcmpl-"), now()
    tokenizer = bridge.tokenizer(entry) if prepared.params.logprobs is not None else None
    if body.stream and (body.n or 1) > 1:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        streams: list[PreparedChat] = [prepared]
        return SseResponse(_choices_chunks(bridge, entry, chat, streams, body.n, chat_id, created, include_usage,
                                           tokenizer), lambda: [p.stream.cancel() for p in streams])
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return SseResponse(_chunks(stream, parser, chat_id, created, entry.name, include_usage, tokenizer),
                           stream.cancel)
    collectors = await collect_choices(bridge, entry, chat, prepared, body.n or 1, request, tokenizer is not None)
    if collectors is None:  # the client left; nobody reads this
        return JSONResponse({}, status_code=499)
    choices = []
    for index, collected in enumerate(collectors):
        finished = collected.finished
        raise_if_failed(finished.reason, finished.error)
        calls = [ToolCallOut(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
                 for c in collected.tool_calls]
        message = AssistantMessage(content=collected.text if collected.text or not calls else None,
                                   reasoning_content=collected.reasoning or None, tool_calls=calls or None)
        choices.append(ChatChoice(index=index, message=message,
                                  finish_reason=finish_reason(finished.reason, has_tool_calls=bool(calls)),
                                  logprobs=chat_logprobs(tokenizer, collected.logprobs) if tokenizer is not None
                                  else None))
    answer = ChatCompletion(id=chat_id, created=created, model=entry.name, choices=choices,
                            usage=choices_usage([c.finished.usage for c in collectors]))
    return JSONResponse(answer.model_dump(exclude_none=True))


async def collect_choices(bridge: EngineBridge, entry, chat: ChatRequest, first: PreparedChat, n: int,
                          request: Request, logprobs: bool) -> list[OutputCollector] | None:
    """The whole answers of ``n`` choices of one chat request: the first runs alone until its first output (its
    prompt is then in the prefix cache), then the others are submitted and prefill only what no block holds.
    None when the client left."""
    collectors = [OutputCollector() for _ in range(n)]
    events = parsed_events(first.stream, first.parser, is_disconnected=request.is_disconnected, logprobs=logprobs)
    more: list[PreparedChat] = []
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                collectors[0].add(event)
                if event is not None and not more and n > 1:
                    more = [bridge.prepare_more(entry, chat, first, i) for i in range(1, n)]
                    break

            async def drain(gen, collector: OutputCollector) -> None:
                async with contextlib.aclosing(gen):
                    async for item in gen:
                        collector.add(item)

            await asyncio.gather(drain(events, collectors[0]), *[
                drain(parsed_events(p.stream, p.parser, is_disconnected=request.is_disconnected, logprobs=logprobs),
                      collectors[i + 1]) for i, p in enumerate(more)])
    finally:
        for p in more:
            p.stream.cancel()  # a no-op for those that finished; the others stop with the request
    return collectors if all(c.finished is not None for c in collectors) else None


async def _chunks(stream, parser, chat_id: str, created: int, model: str, include_usage: bool,
                  tokenizer=None) -> AsyncIterator[str]:
    usages: list = []
    try:
        async for line in _choice_chunks(stream, parser, 0, chat_id, created, model, tokenizer, usages):
            yield line
        if include_usage:
            yield sse(ChatCompletionChunk(id=chat_id, created=created, model=model, choices=[],
                                          usage=usage_of(usages[0])))
        yield SSE_DONE
    except Exception as exc:  # the status line is long gone: report it in the stream (the SDKs raise it)
        yield sse(error_body(failure_of(exc)))
        yield SSE_DONE


async def _choices_chunks(bridge: EngineBridge, entry, chat: ChatRequest, streams: list[PreparedChat], n: int,
                          chat_id: str, created: int, include_usage: bool, tokenizer) -> AsyncIterator[str]:
    """``n`` choices streamed together (``choice_streams.interleave``), each chunk naming its choice's index, as
    OpenAI streams them; ``streams`` collects every choice's stream, so the response can cancel them all."""
    usages: list[list] = [[] for _ in range(n)]
    first = streams[0]

    def lines(prepared: PreparedChat, index: int) -> AsyncIterator[str]:
        return _choice_chunks(prepared.stream, prepared.parser, index, chat_id, created, entry.name, tokenizer,
                              usages[index], keepalive=index == 0)

    def start_more() -> list[AsyncIterator[str]]:
        more = [bridge.prepare_more(entry, chat, first, i) for i in range(1, n)]
        streams.extend(more)
        return [lines(p, i) for i, p in enumerate(more, start=1)]

    try:
        async for line in interleave(lines(first, 0), start_more, n):
            yield line
        if include_usage:
            yield sse(ChatCompletionChunk(id=chat_id, created=created, model=entry.name, choices=[],
                                          usage=choices_usage([u[0] if u else None for u in usages])))
        yield SSE_DONE
    except Exception as exc:  # the status line is long gone: report it in the stream (the SDKs raise it)
        yield sse(error_body(failure_of(exc)))
        yield SSE_DONE
    finally:
        for p in streams:
            p.stream.cancel()


async def _choice_chunks(stream, parser, index: int, chat_id: str, created: int, model: str, tokenizer,
                         usages: list, *, keepalive: bool = True) -> AsyncIterator[str]:
    """One choice's chunks: its role, deltas (text, reasoning, tool calls, log-probabilities) and finish reason;
    its usage is appended to ``usages`` at the end. A failed generation raises."""
    def chunk(delta: ChatDelta, reason: str | None = None) -> str:
        return sse(ChatCompletionChunk(id=chat_id, created=created, model=model,
                                       choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=reason)]))

    yield chunk(ChatDelta(role="assistant", content=""))
    started: set[int] = set()
    async for event in parsed_events(stream, parser, heartbeat_s=HEARTBEAT_S, logprobs=tokenizer is not None):
        if event is None:
            if keepalive:
                yield SSE_KEEPALIVE
        elif isinstance(event, Logprobs):  # the log-probabilities of the tokens just sent, in a chunk of their own
            yield sse(ChatCompletionChunk(id=chat_id, created=created, model=model, choices=[ChatChunkChoice(
                index=index, delta=ChatDelta(), logprobs=chat_logprobs(tokenizer, event.entries))]))
        elif isinstance(event, Finished):
            raise_if_failed(event.reason, event.error)
            yield chunk(ChatDelta(), finish_reason(event.reason, has_tool_calls=event.has_tool_calls))
            usages.append(event.usage)
            return
        elif event.kind == "text" and event.text:
            yield chunk(ChatDelta(content=event.text))
        elif event.kind == "reasoning" and event.text:
            yield chunk(ChatDelta(reasoning_content=event.text))
        elif event.kind == "tool_call":
            args = event.arguments_delta
            if event.tool_index not in started:
                started.add(event.tool_index)
                delta = ToolCallDelta(index=event.tool_index, id=event.tool_id, type="function",
                                      function=ToolCallDeltaFunction(name=event.name, arguments=args))
            elif args:
                delta = ToolCallDelta(index=event.tool_index, function=ToolCallDeltaFunction(arguments=args))
            else:
                continue
            yield chunk(ChatDelta(tool_calls=[delta]))
