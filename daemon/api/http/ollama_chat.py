"""Ollama's ``/api/chat`` and ``/api/generate``: translated into moed's one chat request (or a raw prompt), run
through the family's output parser, answered as Ollama's objects (``ollama._types``), streamed as NDJSON by
default as Ollama does.

* Messages: ``tool_calls`` (arguments as objects) get call ids so the templates can pair them with the ``tool``
  messages that answer them (``tool_name``); ``thinking`` goes back as the template's ``reasoning_content``;
  images become the text-only placeholder.
* Output: text deltas as ``message.content`` (``response``), reasoning as ``thinking``, tool calls as
  ``message.tool_calls`` with their arguments parsed, once each call is complete; the last object has
  ``done: true``, ``done_reason`` and the counts and durations (nanoseconds).
* A request with no messages (no prompt) only loads the model (``done_reason: "load"``), or with ``keep_alive: 0``
  unloads it (``"unload"``), as Ollama's clients use it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from ollama._types import ChatRequest as OllamaChatRequest
from ollama._types import ChatResponse, GenerateRequest, GenerateResponse, Message
from pydantic import ValidationError

from moed.api.http.bridge import EngineBridge
from moed.api.http.chat_request import ChatRequest, media_placeholder
from moed.api.http.error_status import ParamError, validation_failure
from moed.api.http.ollama_options import (format_grammar, keep_alive_of, merged_options, num_ctx_of, sampling_params,
                                          think_variables)
from moed.api.http.output_stream import Finished, Logprobs, parsed_events
from moed.api.http.sse_response import SseResponse
from moed.engine.request import Usage

NDJSON = "application/x-ndjson"
DONE_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ParamError(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(data, dict):
        raise ParamError("the request body must be a JSON object")
    return data


def parse_request(kind: type, raw: bytes) -> tuple[Any, dict[str, Any]]:
    """The body as ``kind`` (an ``ollama._types`` request, for its field types) and as the raw JSON object (tools
    and schemas exactly as sent)."""
    data = json_object(raw)
    try:
        return kind.model_validate(data), data
    except ValidationError as exc:
        failure = validation_failure(list(exc.errors()))
        raise ParamError(failure.message, failure.param) from None


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def chat_messages(raw_messages: list[Any], system: str = "") -> tuple[list[dict[str, Any]], int]:
    """Ollama messages -> the HF-style dicts chat templates read (and the number of images dropped)."""
    out: list[dict[str, Any]] = []
    dropped = 0
    pending: list[tuple[str, str]] = []  # (call id, name) of calls not answered yet
    for i, m in enumerate(raw_messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ParamError(f"{where} must be an object with role system, user, assistant or tool", f"{where}.role")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise ParamError(f"{where}.content must be a string", f"{where}.content")
        if m.get("images"):
            dropped += len(m["images"])
            content = "\n".join([content] + [media_placeholder("image")] * len(m["images"])).strip()
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "assistant":
            if m.get("thinking"):
                msg["reasoning_content"] = m["thinking"]
            calls = []
            for j, call in enumerate(m.get("tool_calls") or []):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise ParamError(f"{where}.tool_calls[{j}] must be {{\"function\": {{\"name\", \"arguments\"}}}}",
                                     f"{where}.tool_calls")
                call_id = f"call_{i}_{j}"
                pending.append((call_id, function["name"]))
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": function["name"], "arguments": function.get("arguments") or {}}})
            if calls:
                msg["tool_calls"] = calls
        elif m["role"] == "tool":
            name = m.get("tool_name") or m.get("name") or ""
            match = next((p for p in pending if p[1] == name), pending[0] if pending else None)
            if match is None:
                raise ParamError(f"{where} (tool) answers no earlier assistant tool call; send the assistant message "
                                 "with its tool_calls first", f"{where}")
            pending.remove(match)
            msg.update(tool_call_id=match[0], name=match[1])
        out.append(msg)
    if system and not any(m["role"] == "system" for m in out):
        out.insert(0, {"role": "system", "content": system})
    return out, dropped


def _durations(usage: Usage | None, started: float, load_s: float) -> dict[str, int]:
    total = time.perf_counter() - started
    if usage is None:
        return {"total_duration": int(total * 1e9), "load_duration": int(load_s * 1e9)}
    decode = usage.completion_tokens / usage.decode_tok_s if usage.decode_tok_s > 0 else 0.0
    return {"total_duration": int(total * 1e9), "load_duration": int(load_s * 1e9),
            "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": int(usage.ttft_s * 1e9),
            "eval_count": usage.completion_tokens, "eval_duration": int(decode * 1e9)}


def _line(obj) -> str:
    return json.dumps(obj.model_dump(exclude_none=True, mode="json")) + "\n"


class _Calls:
    """Tool calls as the parser streams them, handed out whole (Ollama sends each call once, arguments parsed)."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, str]] = {}

    def add(self, event) -> None:
        call = self.calls.setdefault(event.tool_index, {"name": "", "arguments": ""})
        call["name"] = event.name or call["name"]
        call["arguments"] += event.arguments_delta

    def take(self) -> list[Message.ToolCall]:
        out = []
        for index in sorted(self.calls):
            call = self.calls[index]
            try:
                arguments = json.loads(call["arguments"]) if call["arguments"].strip() else {}
            except json.JSONDecodeError:
                arguments = {"_raw": call["arguments"]}  # the model wrote no JSON; kept rather than dropped
            if not isinstance(arguments, dict):
                arguments = {"value": arguments}
            out.append(Message.ToolCall(function=Message.ToolCall.Function(name=call["name"], arguments=arguments)))
        self.calls.clear()
        return out


async def _load_only(bridge: EngineBridge, model: str, keep_alive, chat: bool) -> Response:
    entry = await bridge.acquire(model, keep_alive=keep_alive, load_only=True)
    reason = "unload" if keep_alive == 0 else "load"
    if chat:
        return JSONResponse(ChatResponse(model=entry.name, created_at=now_iso(), done=True, done_reason=reason,
                                         message=Message(role="assistant", content="")).model_dump(exclude_none=True))
    return JSONResponse(GenerateResponse(model=entry.name, created_at=now_iso(), done=True, done_reason=reason,
                                         response="").model_dump(exclude_none=True))


async def ollama_chat(bridge: EngineBridge, raw: bytes, request: Request) -> Response:
    body, data = parse_request(OllamaChatRequest, raw)
    keep_alive = keep_alive_of(data.get("keep_alive"))
    if not data.get("messages"):
        return await _load_only(bridge, body.model, keep_alive, chat=True)
    started = time.perf_counter()
    entry = await bridge.acquire(body.model, keep_alive=keep_alive, context_length=num_ctx_of(data.get("options")))
    load_s = time.perf_counter() - started
    options = merged_options(entry, data.get("options"))
    predict = options.get("num_predict")
    system = entry.found.system if entry.found is not None else ""
    messages, dropped = chat_messages(data["messages"], system)
    tools = data.get("tools") or []
    if not isinstance(tools, list):
        raise ParamError("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    chat = ChatRequest(messages, tools, think_variables(body.think),
                       sampling_params(options, room=entry.loop.context_length, grammar=format_grammar(body.format)),
                       max_tokens=predict if isinstance(predict, int) and predict > 0 else None,
                       stream=body.stream is not False, dropped_media=dropped)
    prepared = bridge.prepare_chat(entry, chat)
    events = _chat_objects(prepared, entry.name, started, load_s, request)
    if body.stream is not False:
        return SseResponse(_with_errors(events), prepared.stream.cancel, media_type=NDJSON)
    return await _whole(events, chat=True)


async def _answer_events(prepared, request: Request) -> AsyncIterator:
    """The parsed events Ollama's objects are made of (no heartbeats, no log-probabilities); a failed generation
    raises at its Finished."""
    events = parsed_events(prepared.stream, prepared.parser, is_disconnected=request.is_disconnected)
    async with contextlib.aclosing(events):
        async for event in events:
            if event is None or isinstance(event, Logprobs):
                continue
            if isinstance(event, Finished):
                _raise_if_failed(event)
            yield event


async def _chat_objects(prepared, model: str, started: float, load_s: float, request: Request
                        ) -> AsyncIterator[str]:
    """NDJSON lines of a chat answer (content / thinking deltas, whole tool calls, the final object)."""
    calls = _Calls()
    events = _answer_events(prepared, request)
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                whole = calls.take()
                if whole:
                    yield _line(ChatResponse(model=model, created_at=now_iso(), done=False,
                                             message=Message(role="assistant", content="", tool_calls=whole)))
                reason = DONE_REASONS.get(event.reason, "stop")
                yield _line(ChatResponse(model=model, created_at=now_iso(), done=True, done_reason=reason,
                                         message=Message(role="assistant", content=""),
                                         **_durations(event.usage, started, load_s)))
                return
            if event.kind == "tool_call":
                calls.add(event)
            elif event.text:
                message = (Message(role="assistant", content="", thinking=event.text) if event.kind == "reasoning"
                           else Message(role="assistant", content=event.text))
                yield _line(ChatResponse(model=model, created_at=now_iso(), done=False, message=message))


async def _with_errors(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream that fails midway ends with Ollama's ``{"error": "..."}`` line (the status was sent already)."""
    from moed.errors import MoedError

    async with contextlib.aclosing(lines):
        try:
            async for line in lines:
                yield line
        except MoedError as exc:
            yield json.dumps({"error": str(exc)}) + "\n"


def _raise_if_failed(event: Finished) -> None:
    if event.reason == "error":
        from moed.errors import MoedError

        raise MoedError(f"generation failed: {event.error}")


async def _whole(lines: AsyncIterator[str], *, chat: bool) -> Response:
    """A non-streamed answer: the streamed objects folded into one."""
    content, thinking, tool_calls, last = [], [], [], {}
    async with contextlib.aclosing(lines):
        async for line in lines:
            obj = json.loads(line)
            part = obj.get("message", {}) if chat else obj
            content.append(part.get("content" if chat else "response", ""))
            thinking.append(part.get("thinking", ""))
            tool_calls += part.get("tool_calls", []) if chat else []
            last = obj
    text, thought = "".join(content), "".join(thinking)
    if chat:
        last["message"] = {"role": "assistant", "content": text, **({"thinking": thought} if thought else {}),
                           **({"tool_calls": tool_calls} if tool_calls else {})}
    else:
        last["response"] = text
        if thought:
            last["thinking"] = thought
    return JSONResponse(last)


async def ollama_generate(bridge: EngineBridge, raw: bytes, request: Request) -> Response:
    body, data = parse_request(GenerateRequest, raw)
    keep_alive = keep_alive_of(data.get("keep_alive"))
    for field in ("suffix", "context", "template"):
        if data.get(field):
            raise ParamError(f"{field} is not supported: " + {
                "suffix": "fill-in-the-middle needs a model trained for it; send the whole prompt",
                "context": "it is deprecated in Ollama; send the conversation to /api/chat",
                "template": "moed renders prompts with the model's own chat template; send raw: true with the "
                            "prompt already formatted"}[field] + "; leave it out", field)
    if not body.prompt:
        return await _load_only(bridge, body.model, keep_alive, chat=False)
    started = time.perf_counter()
    entry = await bridge.acquire(body.model, keep_alive=keep_alive, context_length=num_ctx_of(data.get("options")))
    load_s = time.perf_counter() - started
    options = merged_options(entry, data.get("options"))
    predict = options.get("num_predict")
    grammar = format_grammar(body.format)
    if body.raw:  # the prompt as it is, no template
        prompt_ids = bridge.encode(entry, body.prompt)
        bridge.check_prompt_fits(entry, prompt_ids)
        room = bridge.default_max_tokens(entry, prompt_ids)
        params = sampling_params(options, room=room, grammar=grammar)
        stream = bridge.open_stream(entry, prompt_ids, params)
        lines = _raw_objects(stream, entry.name, started, load_s, request)
        cancel = stream.cancel
    else:
        system = body.system or (entry.found.system if entry.found is not None else "")
        images = len(data.get("images") or [])
        prompt = "\n".join([body.prompt] + [media_placeholder("image")] * images)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        chat = ChatRequest(messages, [], think_variables(body.think),
                           sampling_params(options, room=entry.loop.context_length, grammar=grammar),
                           max_tokens=predict if isinstance(predict, int) and predict > 0 else None,
                           stream=body.stream is not False, dropped_media=images)
        prepared = bridge.prepare_chat(entry, chat)
        lines = _generate_objects(prepared, entry.name, started, load_s, request)
        cancel = prepared.stream.cancel
    if body.stream is not False:
        return SseResponse(_with_errors(lines), cancel, media_type=NDJSON)
    return await _whole(lines, chat=False)


async def _generate_objects(prepared, model: str, started: float, load_s: float, request: Request
                            ) -> AsyncIterator[str]:
    events = _answer_events(prepared, request)
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                yield _line(GenerateResponse(model=model, created_at=now_iso(), done=True, response="",
                                             done_reason=DONE_REASONS.get(event.reason, "stop"),
                                             **_durations(event.usage, started, load_s)))
                return
            if event.kind in ("text", "reasoning") and event.text:
                yield _line(GenerateResponse(model=model, created_at=now_iso(), done=False,
                                             **({"thinking": event.text, "response": ""} if event.kind == "reasoning"
                                                else {"response": event.text})))


async def _raw_objects(stream, model: str, started: float, load_s: float, request: Request) -> AsyncIterator[str]:
    events = stream.events(is_disconnected=request.is_disconnected)
    async with contextlib.aclosing(events):
        async for event in events:
            if event is None:
                continue
            if event.text:
                yield _line(GenerateResponse(model=model, created_at=now_iso(), done=False, response=event.text))
            if event.done:
                _raise_if_failed(Finished(event.finish_reason, event.usage, event.error))
                yield _line(GenerateResponse(model=model, created_at=now_iso(), done=True, response="",
                                             done_reason=DONE_REASONS.get(event.finish_reason, "stop"),
                                             **_durations(event.usage, started, load_s)))
                return
