"""The request shapes the official SDKs define, sent to moed: each is read, or refused with a 400 naming it.

moed's request models (api/http/anthropic_protocol.py, openai_protocol.py) are pydantic subsets that
accept unknown fields; these tests hold them against the SDKs' own type definitions (the ``anthropic``
and ``openai`` packages' TypedDict params, read at test time, so a newer SDK brings its new shapes in):

- every request field moed reads is one the SDK defines (or a listed extension other servers share),
  and every field the SDK requires, moed requires;
- every message role and every content block / part / input item / tool type the SDK defines, built
  with the SDK's required keys, gets an answer: 200 (read, or shown to the model as a placeholder) or a
  400 whose message names the type. Never a 422/500, never a silent drop.
"""

from __future__ import annotations

import collections.abc
import inspect
import json
import typing
from typing import Any

import pytest

from helpers.http_daemon import ChatScriptedModel, add_scripted_model, start_http_daemon, tools_tokenizer
from helpers.http_daemon import post_json as post
from helpers.tiny_tokenizer import CHATML_TEMPLATE
from moed.api.http import anthropic_protocol as ap
from moed.api.http import openai_protocol as op

anthropic_types = pytest.importorskip("anthropic.types")
openai_types = pytest.importorskip("openai.types")

# ---- reading the SDKs' TypedDicts ----------------------------------------------------------------


def _strip(hint: Any) -> Any:
    while typing.get_origin(hint) in (typing.Annotated, typing.Required, typing.NotRequired):
        hint = typing.get_args(hint)[0]
    return hint


def _members(hint: Any) -> list[Any]:
    """The alternatives of a union (one for a plain type), Annotated/Required stripped."""
    hint = _strip(hint)
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [m for a in typing.get_args(hint) for m in _members(a)]
    return [hint]


def _is_typeddict(hint: Any) -> bool:
    return isinstance(hint, type) and hasattr(hint, "__required_keys__")


def _hints(td: type) -> dict[str, Any]:
    return typing.get_type_hints(td, include_extras=True)


def _required(td: type) -> set[str]:
    """The keys ``td`` requires. (``__required_keys__`` misses ``Required[...]`` written in string
    annotations before Python 3.12, which is how the SDKs write them.)"""
    hints = _hints(td)
    marked = {k for k, h in hints.items() if typing.get_origin(h) is typing.Required}
    if getattr(td, "__total__", True):
        marked |= {k for k, h in hints.items() if typing.get_origin(h) is not typing.NotRequired}
    return marked


def _tag(td: type, key: str = "type") -> list[str]:
    """The literal values of ``td``'s ``key`` field ([] when it has none)."""
    hint = _hints(td).get(key)
    return [v for m in _members(hint) if typing.get_origin(m) is typing.Literal for v in typing.get_args(m)] \
        if hint is not None else []


def _tagged_members(hint: Any, key: str = "type") -> dict[str, type]:
    """tag value -> TypedDict, over the union ``hint`` (lists/iterables of it looked into)."""
    out: dict[str, type] = {}
    for m in _members(hint):
        origin = typing.get_origin(m)
        if origin in (list, collections.abc.Iterable, collections.abc.Sequence):
            out.update(_tagged_members(typing.get_args(m)[0], key))
        elif _is_typeddict(m):
            for tag in _tag(m, key):
                out.setdefault(tag, m)
    return out


def minimal(hint: Any, depth: int = 0) -> Any:
    """A value of type ``hint`` with only what the SDK requires filled in (strings "x", numbers 0, ...)."""
    hint = _strip(hint)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return typing.get_args(hint)[0]
    if _is_typeddict(hint):
        hints = _hints(hint)
        return {k: minimal(hints[k], depth + 1) for k in sorted(_required(hint))} if depth < 6 else {}
    if origin in (typing.Union,) or str(origin) == "<class 'types.UnionType'>":
        options = [m for m in _members(hint) if m is not type(None)]
        return minimal(options[0], depth + 1)
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence, set, frozenset):
        return []
    if origin in (dict, collections.abc.Mapping) or hint in (dict, object):
        return {}
    return {str: "x", int: 0, float: 0.0, bool: False}.get(hint, "x")


def sample(td: type, tag: str, key: str = "type") -> dict:
    """``minimal(td)`` with its tag set (a tag the SDK marks optional is still what selects the shape)."""
    return {**minimal(td), key: tag}


def _create_params(method) -> tuple[set[str], set[str]]:
    """(every keyword, the required ones) of an SDK resource method such as Messages.create."""
    skip = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
    params = {n: p for n, p in inspect.signature(method).parameters.items() if n not in skip}
    return set(params), {n for n, p in params.items() if p.default is inspect.Parameter.empty}


def _wire_fields(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


# ---- a daemon to send them to -------------------------------------------------------------------

MODEL = "sdk-shapes"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_http_daemon()
    model = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("tok"), CHATML_TEMPLATE), lambda p: "ok",
                              family="mixtral")
    add_scripted_model(d, MODEL, model, context_length=4096)
    yield d
    d.close()


def _error_text(reply: dict) -> str:
    return json.dumps(reply.get("error", reply))


def assert_read_or_named(status: int, reply: dict, kind: str) -> None:
    assert status in (200, 400), (kind, status, reply)
    if status == 400:
        assert repr(kind) in _error_text(reply) or f'"{kind}"' in _error_text(reply) or kind in _error_text(reply), \
            (kind, reply)


# ---- Anthropic Messages --------------------------------------------------------------------------

# sampling fields of earlier API versions that clients still send (the 2.x SDK no longer defines them)
ANTHROPIC_EARLIER_FIELDS = {"temperature", "top_p", "top_k"}


def test_anthropic_fields_are_the_sdks():
    from anthropic.resources.messages import Messages

    sdk_fields, sdk_required = _create_params(Messages.create)
    ours = _wire_fields(ap.MessagesRequest)
    assert ours - sdk_fields - ANTHROPIC_EARLIER_FIELDS == set()
    required = {name for name, f in ap.MessagesRequest.model_fields.items() if f.is_required()}
    assert sdk_required <= required


def test_anthropic_roles_are_the_sdks():
    sdk_roles = {r for m in _members(anthropic_types.MessageParam) for r in _tag(m, "role")}
    ours = set(typing.get_args(ap.InputMessage.model_fields["role"].annotation))
    assert sdk_roles == ours


def _anthropic_blocks(role: str) -> dict[str, type]:
    param = {"user": anthropic_types.MessageParam, "assistant": anthropic_types.MessageParam}[role]
    found: dict[str, type] = {}
    for m in _members(param):
        if role in _tag(m, "role"):
            found.update(_tagged_members(_hints(m)["content"]))
    return found


OTHER_ROLE_ONLY = {"user": {"thinking", "redacted_thinking", "tool_use"}, "assistant": {"tool_result"}}


@pytest.mark.parametrize("role", ["user", "assistant"])
def test_every_anthropic_content_block_type_is_read(daemon, role):
    blocks = _anthropic_blocks(role)
    assert {"text", "image", "document", "tool_use", "tool_result", "thinking"} <= set(blocks) | {"tool_use"}
    for kind, td in sorted(blocks.items()):
        block = sample(td, kind)
        if kind == "tool_result":
            block["tool_use_id"] = "call_1"
        history = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "f", "input": {}}]}]
        messages = history + [{"role": role, "content": [block]}]
        if role == "assistant":
            messages.append({"role": "user", "content": "go on"})
        status, reply = post(daemon, "/v1/messages/count_tokens", {"model": MODEL, "messages": messages})
        if kind in OTHER_ROLE_ONLY[role]:  # the SDK's one block union serves both roles; the API does not
            assert_read_or_named(status, reply, kind)
            continue
        assert status == 200, (kind, block, reply)  # every block type: read, or a placeholder the model sees
        assert reply["input_tokens"] > 0


# ---- OpenAI Chat Completions ---------------------------------------------------------------------

# fields other local servers (vLLM, llama-server, SGLang) accept beyond OpenAI's
CHAT_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "stream", "grammar", "json_schema"}


def test_chat_fields_are_the_sdks():
    from openai.resources.chat.completions import Completions

    sdk_fields, sdk_required = _create_params(Completions.create)
    assert _wire_fields(op.ChatCompletionRequest) - sdk_fields - CHAT_EXTENSIONS == set()
    required = {name for name, f in op.ChatCompletionRequest.model_fields.items() if f.is_required()}
    assert sdk_required - {"model"} <= required  # model may be left out: the one loaded model answers


def _chat(daemon, messages: list[dict], **extra) -> tuple[int, dict]:
    return post(daemon, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4, **extra})


def test_every_chat_role_is_read_or_named(daemon):
    from openai.types.chat import ChatCompletionMessageParam

    roles = {r: m for m in _members(ChatCompletionMessageParam) for r in _tag(m, "role")}
    assert {"system", "developer", "user", "assistant", "tool", "function"} <= set(roles)
    call = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                 "function": {"name": "f", "arguments": "{}"}}]}
    for role, td in roles.items():
        message = sample(td, role, "role")
        history = [{"role": "user", "content": "hi"}, call] if role in ("tool", "function") else []
        if role == "tool":
            message["tool_call_id"] = "call_1"
        status, reply = _chat(daemon, history + [message] + ([{"role": "user", "content": "go"}]
                                                           if role == "assistant" else []))
        assert_read_or_named(status, reply, role)


def test_every_chat_content_part_type_is_read(daemon):
    from openai.types.chat import ChatCompletionContentPartParam

    parts = _tagged_members(ChatCompletionContentPartParam)
    assert {"text", "image_url", "input_audio", "file"} <= set(parts)
    for kind, td in parts.items():
        status, reply = _chat(daemon, [{"role": "user", "content": [sample(td, kind)]}])
        assert status == 200, (kind, reply)  # images, audio and files become placeholders for a text model


def test_every_chat_tool_type_is_read_or_named(daemon):
    from openai.types.chat import ChatCompletionToolUnionParam

    tools = _tagged_members(ChatCompletionToolUnionParam)
    assert {"function", "custom"} <= set(tools)
    for kind, td in tools.items():
        status, reply = _chat(daemon, [{"role": "user", "content": "hi"}], tools=[sample(td, kind)])
        assert_read_or_named(status, reply, kind)


# ---- OpenAI Responses ----------------------------------------------------------------------------

RESPONSES_EXTENSIONS = {"stream", "top_k", "min_p", "repetition_penalty", "seed"}


def test_responses_fields_are_the_sdks():
    from openai.resources.responses import Responses

    from moed.api.http.openai_responses import ResponsesRequest

    sdk_fields, _ = _create_params(Responses.create)
    assert _wire_fields(ResponsesRequest) - sdk_fields - RESPONSES_EXTENSIONS == set()


def _respond(daemon, items: list[dict], **extra) -> tuple[int, dict]:
    return post(daemon, "/v1/responses", {"model": MODEL, "input": items, "max_output_tokens": 4, **extra})


def test_every_responses_input_item_type_is_read_or_named(daemon):
    from openai.types.responses import ResponseInputItemParam

    items = _tagged_members(ResponseInputItemParam)
    assert {"message", "function_call", "function_call_output", "reasoning"} <= set(items)
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    for kind, td in items.items():
        item = sample(td, kind)
        if kind == "function_call_output":
            item["call_id"] = "call_1"
        history = [{"role": "user", "content": "hi"}, call] if kind == "function_call_output" else []
        status, reply = _respond(daemon, history + [item, {"role": "user", "content": "go"}])
        assert_read_or_named(status, reply, kind)


def test_every_responses_tool_type_is_offered_left_out_or_named(daemon):
    from openai.types.responses import ToolParam

    tools = _tagged_members(ToolParam)
    assert {"function", "namespace", "custom", "web_search"} <= set(tools)
    for kind, td in tools.items():
        status, reply = _respond(daemon, [{"role": "user", "content": "hi"}], tools=[sample(td, kind)])
        if kind in ("function", "namespace") or kind.startswith(("web_search", "file_search", "code_interpreter")):
            assert status == 200, (kind, reply)  # offered to the model, or a hosted tool left out with a warning
        assert_read_or_named(status, reply, kind)
