"""POST /v1/responses: OpenAI's Responses API (what Codex CLI speaks) over the same chat path.

``input`` items (messages, ``function_call``, ``function_call_output``, ``reasoning``) become chat
messages for the model's template; the parsed output becomes ``reasoning``, ``message`` and
``function_call`` output items, streamed with the Responses event sequence (response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta / response.reasoning_text.delta / response.function_call_arguments.delta,
the matching .done events, response.output_item.done, and response.completed, or
response.incomplete when the token limit cut the answer). Nothing is stored: ``previous_response_id``
is refused; send the whole conversation in ``input`` (Codex does). Tools of other types than
"function" (hosted tools such as web_search) are left out of the prompt; tool_choice is handled
as in chat completions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from moed.api.http.bridge import EngineBridge
from moed.api.http.chat_request import ChatRequest, media_placeholder
from moed.api.http.error_status import ParamError, failure_of, refuse_fields
from moed.api.http.openai_chat import arguments_value, effort_variables
from moed.api.http.openai_protocol import (ErrorDetail, FunctionCallItem, IncompleteDetails, OutputMessageItem,
                                           OutputText, ReasoningItem, ReasoningText, ResponseObject,
                                           ResponsesRequest, ResponsesUsage)
from moed.api.http.openai_shared import (ERROR_CODES, HEARTBEAT_S, REFUSED_RESPONSES, SSE_KEEPALIVE, chat_logprobs,
                                         new_id, now, raise_if_failed, sampling_params)
from moed.api.http.output_stream import Finished, Logprobs, parsed_events
from moed.api.http.sse_response import SseResponse
from moed.api.http.structured_output import responses_grammar
from moed.text.chat_template import validate_messages

TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # an `include` entry: the answer's token log-probabilities
log = logging.getLogger("moed.http")


MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def _text_of(content: Any, where: str, field: str = "content", dropped: list[int] | None = None) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError(f"{where}.{field} must be a string or a list of input_text parts", f"{where}.{field}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in MEDIA_PARTS:  # a text-only model sees a placeholder; the agent's session goes on
            if dropped is not None:
                dropped[0] += 1
            texts.append(media_placeholder(kind.removeprefix("input_")))
            continue
        if not isinstance(part, dict) or kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ParamError(f"{where}.{field}[{j}] is a {kind!r} part; moed serves text models, so only "
                             "input_text / output_text parts (and images or files, shown as a placeholder) are "
                             "accepted", f"{where}.{field}")
        texts.append(part["text"])
    return "\n".join(texts)


def template_messages(body: ResponsesRequest, dropped: list[int] | None = None) -> list[dict[str, Any]]:
    """``instructions`` + ``input`` items -> HF-style chat messages (leading system texts merged into one)."""
    system: list[str] = [body.instructions] if body.instructions else []
    out: list[dict[str, Any]] = []
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise ParamError("input is empty; give a string or at least one message item", "input")
    call_names: dict[str, str] = {}
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        if out and out[-1]["role"] == "assistant" and not out[-1].get("_closed"):
            msg = out[-1]
        else:
            msg = {"role": "assistant", "content": ""}
            out.append(msg)
        if reasoning:
            msg["reasoning_content"] = reasoning
            reasoning = ""
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ParamError(f"{where}.role is {role!r}; use user, system, developer or assistant",
                                 f"{where}.role")
            text = _text_of(item.get("content", ""), where, dropped=dropped)
            if role in ("system", "developer"):
                if not out:
                    system.append(text)
                else:
                    out.append({"role": "system", "content": text})
            elif role == "assistant":
                msg = assistant()
                msg["content"] = (msg["content"] + "\n" + text) if msg["content"] else text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise ParamError(f"{where} (function_call) needs a 'call_id' and a 'name'", where)
            arguments = item.get("arguments") or ""
            if not isinstance(arguments, (str, dict)):
                raise ParamError(f"{where}.arguments must be the call's arguments as a JSON string, got "
                                 f"{type(arguments).__name__}", f"{where}.arguments")
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
            call_names[call_id] = name
            msg = assistant()
            msg.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": arguments_value(arguments)}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in call_names:
                raise ParamError(f"{where} (function_call_output) answers call_id {call_id!r}, but no earlier "
                                 "function_call item has that call_id", f"{where}.call_id")
            if out and out[-1]["role"] == "assistant":
                out[-1]["_closed"] = True
            out.append({"role": "tool", "tool_call_id": call_id, "name": call_names[call_id],
                        "content": _text_of(item.get("output", ""), where, "output", dropped)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text", ""), str)
                                                      for p in parts):
                raise ParamError(f"{where} (reasoning) needs 'content' (or 'summary') as a list of "
                                 "{'type': 'reasoning_text', 'text': ...} parts", f"{where}.content")
            reasoning = "\n".join(p.get("text", "") for p in parts)
        else:
            raise ParamError(f"{where} is a {kind!r} item; moed accepts message, function_call, "
                             "function_call_output and reasoning items", f"{where}.type")
    for msg in out:
        msg.pop("_closed", None)
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return validate_messages(out)


NAMESPACE_SEPARATOR = "."  # a namespace tool's function "f" of namespace "ns" is offered to the model as "ns.f"
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                "image_generation", "mcp", "local_shell", "tool_search")
_DATED = re.compile(r"_\d{4}_\d{2}_\d{2}$")  # "web_search_2025_08_26": a dated version of "web_search"


def is_hosted_tool(kind: str | None) -> bool:
    return bool(kind) and _DATED.sub("", kind) in HOSTED_TOOLS


def _function(name: str, t: dict[str, Any] | ResponsesTool) -> dict[str, Any]:
    get = t.get if isinstance(t, dict) else (lambda k: getattr(t, k, None))
    return {"type": "function", "function": {k: v for k, v in (("name", name), ("description", get("description")),
                                                               ("parameters", get("parameters"))) if v is not None}}


def request_tools(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The tools to offer, as OpenAI-style function schemas: "function" tools as they are, each function of
    a "namespace" tool as "namespace.function"; hosted tools (web_search, ...) need OpenAI's servers and are
    left out, with a warning in the log; any other type is refused with a 400 naming it."""
    if not body.tools or body.tool_choice == "none":
        return []
    tools, hosted = [], []
    for i, t in enumerate(body.tools):
        if t.type == "function" and t.name:
            tools.append(_function(t.name, t))
        elif t.type == "namespace" and t.name:
            for sub in t.tools or []:
                if isinstance(sub, dict) and sub.get("type", "function") == "function" and sub.get("name"):
                    tools.append(_function(f"{t.name}{NAMESPACE_SEPARATOR}{sub['name']}", sub))
        elif is_hosted_tool(t.type):
            hosted.append(t.type)
        else:
            raise ParamError(f"tools[{i}] has type {t.type!r}, which moed cannot offer to a local model; it takes "
                             f"function and namespace tools (hosted tools such as web_search are left out)",
                             f"tools[{i}].type")
    if hosted:
        log.warning("request tools %s run on OpenAI's servers; moed left them out of the prompt", ", ".join(hosted))
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        tools = [t for t in tools if t["function"]["name"] == choice.name]
        if not tools:
            raise ParamError(f"tool_choice names function {choice.name!r}, which is not among the request's "
                             "function tools", "tool_choice")
    return tools


def chat_request(body: ResponsesRequest) -> ChatRequest:
    """The request as moed's one internal chat request."""
    dropped = [0]
    messages = template_messages(body, dropped)
    variables = effort_variables(body.reasoning.effort if body.reasoning else None)
    params = sampling_params(body, max_tokens=body.max_output_tokens or 1, grammar=responses_grammar(body))
    if LOGPROBS_INCLUDE in (body.include or ()):
        params = dataclasses.replace(params, logprobs=body.top_logprobs or 0)
    forced = body.tool_choice == "required" or (body.tool_choice is not None and not isinstance(body.tool_choice, str))
    return ChatRequest(messages, request_tools(body), variables, params, max_tokens=body.max_output_tokens,
                       forced_tools=forced and bool(body.tools), parallel_tool_calls=body.parallel_tool_calls is not False,
                       stream=body.stream, dropped_media=dropped[0])


def split_namespace(name: str, namespaces: frozenset[str]) -> tuple[str | None, str]:
    """(namespace, function name) of a called tool name ("ns.f" for a namespace tool's function)."""
    ns, sep, rest = name.partition(NAMESPACE_SEPARATOR)
    return (ns, rest) if sep and ns in namespaces and rest else (None, name)


class ResponseBuilder:
    """Parsed output events -> output items, and the Responses stream events that build them."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.response = ResponseObject(
            id=new_id("resp_"), created_at=now(), status="in_progress", model=model, instructions=body.instructions,
            tools=[t.model_dump(exclude_none=True) for t in body.tools or []],
            tool_choice=body.tool_choice if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(), temperature=body.temperature, top_p=body.top_p,
            max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls)
        if self.response.tool_choice is None:
            self.response.tool_choice = "auto"
        if isinstance(body.text, dict) and isinstance(body.text.get("format"), dict):
            self.response.text = {"format": body.text["format"]}  # the SDK's parse() reads the answer by it
        self._pending_logprobs: list = []  # token log-probabilities that came before any item opened
        self._namespaces = frozenset(t.name for t in body.tools or [] if t.type == "namespace" and t.name)
        self._seq = 0
        self._open: Any = None  # the item being written, with _kind and _tool_index
        self._open_kind = ""
        self._open_tool_index: int | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(exclude_none=True)

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def _index(self) -> int:
        return len(self.response.output) - 1

    def _begin(self, kind: str, event: Any) -> list[dict[str, Any]]:
        if kind == "message":
            item: Any = OutputMessageItem(id=new_id("msg_"), status="in_progress", content=[])
            part: dict[str, Any] | None = OutputText(text="").model_dump()
        elif kind == "reasoning":
            item = ReasoningItem(id=new_id("rs_"), status="in_progress", content=[])
            part = ReasoningText(text="").model_dump()
        else:
            namespace, name = split_namespace(event.name, self._namespaces)
            item = FunctionCallItem(id=new_id("fc_"), call_id=event.tool_id, name=name, namespace=namespace,
                                    arguments="", status="in_progress")
            part = None
        self.response.output.append(item)
        self._open, self._open_kind = item, kind
        self._open_tool_index = event.tool_index if kind == "function_call" else None
        out = [self._event("response.output_item.added", output_index=self._index(),
                           item=item.model_dump(exclude_none=True))]
        if part is not None:
            out.append(self._event("response.content_part.added", item_id=item.id, output_index=self._index(),
                                   content_index=0, part=part))
        return out

    def _close(self) -> list[dict[str, Any]]:
        item, kind, i = self._open, self._open_kind, self._index()
        if item is None:
            return []
        self._open, self._open_kind, self._open_tool_index = None, "", None
        item.status = "completed"
        out = []
        if kind == "message":
            text = item.content[0].text if item.content else ""
            if not item.content:
                item.content = [OutputText(text="")]
            out += [self._event("response.output_text.done", item_id=item.id, output_index=i, content_index=0,
                                text=text, logprobs=[e.model_dump() for e in item.content[0].logprobs]),
                    self._event("response.content_part.done", item_id=item.id, output_index=i, content_index=0,
                                part=item.content[0].model_dump())]
        elif kind == "reasoning":
            if not item.content:
                item.content = [ReasoningText(text="")]
            out += [self._event("response.reasoning_text.done", item_id=item.id, output_index=i, content_index=0,
                                text=item.content[0].text),
                    self._event("response.content_part.done", item_id=item.id, output_index=i, content_index=0,
                                part=item.content[0].model_dump())]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=i,
                                   name=item.name, arguments=item.arguments))
        out.append(self._event("response.output_item.done", output_index=i, item=item.model_dump(exclude_none=True)))
        return out

    def add_logprobs(self, entries, tokenizer) -> None:
        """The log-probabilities of the tokens just parsed, onto the open message's text (those of reasoning and
        tool calls have no place in a Responses answer)."""
        if self._open is None:  # the parser holds these tokens' text back: it decides where they go later
            self._pending_logprobs.extend(entries)
            return
        entries, self._pending_logprobs = [*self._pending_logprobs, *entries], []
        if self._open_kind == "message" and self._open.content:
            self._open.content[0].logprobs.extend(chat_logprobs(tokenizer, entries).content)

    def add(self, event: Any) -> list[dict[str, Any]]:
        """The stream events for one parsed output event."""
        kind = {"text": "message", "reasoning": "reasoning", "tool_call": "function_call"}.get(event.kind)
        if kind is None:
            return []
        if kind != "function_call" and not event.text:
            return []
        out: list[dict[str, Any]] = []
        if self._open_kind != kind or (kind == "function_call" and self._open_tool_index != event.tool_index):
            out += self._close() + self._begin(kind, event)
        item, i = self._open, self._index()
        if kind == "message":
            if not item.content:
                item.content = [OutputText(text="")]
            item.content[0].text += event.text
            out.append(self._event("response.output_text.delta", item_id=item.id, output_index=i, content_index=0,
                                   delta=event.text, logprobs=[]))
        elif kind == "reasoning":
            if not item.content:
                item.content = [ReasoningText(text="")]
            item.content[0].text += event.text
            out.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=i,
                                   content_index=0, delta=event.text))
        else:
            item.name = event.name or item.name
            delta = event.arguments_delta
            if delta:
                item.arguments += delta
                out.append(self._event("response.function_call_arguments.delta", item_id=item.id, output_index=i,
                                       delta=delta))
        return out

    def finish(self, finished: Finished) -> list[dict[str, Any]]:
        """Close the open item; the final event (response.completed / response.incomplete / response.failed)."""
        out = self._close()
        u = finished.usage
        prompt, completion = (u.prompt_tokens, u.completion_tokens) if u is not None else (0, 0)
        reasoning_tokens = 0  # not counted separately: the parser splits text, not tokens
        self.response.usage = ResponsesUsage(input_tokens=prompt, output_tokens=completion,
                                             total_tokens=prompt + completion,
                                             input_tokens_details={"cached_tokens": u.cached_tokens if u else 0},
                                             output_tokens_details={"reasoning_tokens": reasoning_tokens})
        try:
            raise_if_failed(finished.reason, finished.error)
        except Exception as exc:
            return out + self.fail(exc)
        if finished.reason in ("length", "context", "deadline"):
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            if self.response.output:
                self.response.output[-1].status = "incomplete"  # the item the limit cut
            return out + [self._event("response.incomplete", response=self._snapshot())]
        self.response.status = "completed"
        return out + [self._event("response.completed", response=self._snapshot())]

    def fail(self, exc: BaseException) -> list[dict[str, Any]]:
        """Close the open item; response.failed with the error that ended the answer."""
        out = self._close()
        failure = failure_of(exc)
        self.response.status = "failed"
        self.response.error = ErrorDetail(message=failure.message, type="server_error",
                                          code=ERROR_CODES.get(failure.kind, "server_error"))
        return out + [self._event("response.failed", response=self._snapshot())]


async def create_response(bridge: EngineBridge, body: ResponsesRequest, request: Request):
    refuse_fields(body, REFUSED_RESPONSES)
    if getattr(body, "truncation", None) == "auto":
        raise ParamError("truncation 'auto' is not supported: moed refuses a prompt its context cannot hold rather "
                         "than dropping part of it; leave truncation out (or 'disabled')", "truncation")
    if body.previous_response_id:
        raise ParamError("previous_response_id is not supported: moed stores no responses; send the whole "
                         "conversation in 'input'", "previous_response_id")
    entry = await bridge.acquire(body.model)
    prepared = bridge.prepare_chat(entry, chat_request(body))
    parser, stream = prepared.parser, prepared.stream
    builder = ResponseBuilder(body, entry.name)
    tokenizer = bridge.tokenizer(entry) if prepared.params.logprobs is not None else None
    if body.stream:
        return SseResponse(_events(stream, parser, builder, tokenizer), stream.cancel)
    finished = None
    async for event in parsed_events(stream, parser, is_disconnected=request.is_disconnected,
                                     logprobs=tokenizer is not None):
        if isinstance(event, Logprobs):
            builder.add_logprobs(event.entries, tokenizer)
        elif isinstance(event, Finished):
            finished = event
        elif event is not None:
            builder.add(event)
    if finished is None:
        return JSONResponse({}, status_code=499)  # the client left
    raise_if_failed(finished.reason, finished.error)
    builder.finish(finished)
    return JSONResponse(builder.response.model_dump(exclude_none=True))


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _events(stream, parser, builder: ResponseBuilder, tokenizer=None) -> AsyncIterator[str]:
    for event in builder.start():
        yield _sse(event)
    try:
        async for parsed in parsed_events(stream, parser, heartbeat_s=HEARTBEAT_S, logprobs=tokenizer is not None):
            if parsed is None:
                yield SSE_KEEPALIVE
                continue
            if isinstance(parsed, Logprobs):  # they go out with the message's output_text.done and the snapshot
                builder.add_logprobs(parsed.entries, tokenizer)
                continue
            events = builder.finish(parsed) if isinstance(parsed, Finished) else builder.add(parsed)
            for event in events:
                yield _sse(event)
    except Exception as exc:  # the status line is long gone: the stream ends with response.failed
        for event in builder.fail(exc):
            yield _sse(event)
