"""The Anthropic-compatible Messages API, with the official `anthropic` SDK as the client.

Models: "tiny" (a tiny random-init qwen3_moe, for greedy parity with the engine), and scripted
models whose answers are written here (helpers.http_daemon.ChatScriptedModel): "chat" (ChatML
template, no tools), "tools" (a Qwen3-style template that renders tools; the model answers with a
<tool_call> until it sees a tool result), "slow" (a delay per step, for pings during prefill).
"""

from __future__ import annotations

import http.client
import json
import re

import anthropic
import pytest

from helpers.http_daemon import (GENERATION_PROMPT, ChatScriptedModel, add_scripted_model, start_http_daemon,
                                 tools_tokenizer)
from helpers.tiny_models import build_tiny_model_dir
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.api.http import anthropic_messages
from moed.api.http.anthropic_messages import BlockBuilder, _clean_problems, template_messages
from moed.api.http.anthropic_protocol import MessagesRequest
from moed.engine.request import GenerationRequest
from moed.engine.sampling import SamplingParams
from moed.text.tokenizer import Tokenizer

CHAT_ANSWERS = {  # the last user message -> what the "chat" model says
    "Hello": "Hello there, how can I help?",
    "Count": "one two three four five six seven eight",
    "Think": "<think>\nThe user wants a greeting.\n</think>\n\nHi!",
}
WEATHER_TOOL = {"name": "get_weather", "description": "The current weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                                  "unit": {"type": "string"}},
                                 "required": ["city"]}}
TOOL_ARGS = {"city": "Paris", "unit": "celsius", "days": [1, 2]}
TOOL_CALL_TEXT = ("Let me check.\n\n<tool_call>\n"
                  + json.dumps({"name": "get_weather", "arguments": TOOL_ARGS}) + "\n</tool_call>")
FINAL_ANSWER = "It is 18 degrees in Paris."
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK has no temperature argument; Anthropic's default is 1


def last_user_text(prompt: str) -> str:
    turn = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    return turn.split("<|im_end|>", 1)[0]


def chat_answer(prompt: str) -> str:
    return CHAT_ANSWERS.get(last_user_text(prompt), "I do not know.")


def slow_answer(prompt: str) -> str:
    return "la " * 500 if last_user_text(prompt) == "Ramble" else "Slow."


def tools_answer(prompt: str) -> str:
    return FINAL_ANSWER if "<tool_response>" in prompt else TOOL_CALL_TEXT


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_http_daemon(build_tiny_model_dir(tmp_path_factory.mktemp("models")), models=("tiny",))
    root = tmp_path_factory.mktemp("tokenizers")
    chatml = Tokenizer(write_tiny_tokenizer(root / "chatml"))
    d.chat = add_scripted_model(d, "chat", ChatScriptedModel(chatml, chat_answer)).runtime.model
    d.tools = add_scripted_model(d, "tools", ChatScriptedModel(tools_tokenizer(root / "tools"), tools_answer)
                                 ).runtime.model
    d.slow = add_scripted_model(d, "slow", ChatScriptedModel(chatml, slow_answer, step_delay_s=0.3)).runtime.model
    yield d
    d.close()


@pytest.fixture(scope="module")
def client(daemon):
    return daemon.anthropic()


def sse_events(daemon, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """POST a streamed request and read the raw SSE: (event name, data) pairs, checking each frame's shape."""
    body = {"temperature": 0, **{k: v for k, v in body.items() if k != "extra_body"}, **body.get("extra_body", {})}
    conn = http.client.HTTPConnection(daemon.server.host, daemon.server.port, timeout=30)
    conn.request("POST", "/v1/messages", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    text = resp.read().decode()
    conn.close()
    events = []
    for frame in text.strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        name, data = name_line[len("event: "):], json.loads(data_line[len("data: "):])
        assert data["type"] == name
        events.append((name, data))
    return events


def raw_post(daemon, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(daemon.server.host, daemon.server.port, timeout=30)
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read().decode())
    conn.close()
    return out


def check_block_order(events: list[tuple[str, dict]]) -> list[dict]:
    """Assert Anthropic's event grammar; return the content blocks as started."""
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    started, open_index = [], None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None, "a block opened before the previous one closed"
            assert data["index"] == len(started)
            open_index = data["index"]
            started.append(data["content_block"])
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None
    return started


# ---- text answers -----------------------------------------------------------------------------

def same_answer(later, first) -> bool:
    """The same message, except that a later request with the same prompt reads more of it from the prefix
    cache (its input + cache-read tokens still add up to the same prompt)."""
    a, b = later.model_dump(exclude={"id", "usage"}), first.model_dump(exclude={"id", "usage"})
    total = lambda u: u.input_tokens + u.cache_read_input_tokens  # noqa: E731
    return (a == b and total(later.usage) == total(first.usage) and later.usage.output_tokens == first.usage.output_tokens
            and later.usage.cache_read_input_tokens >= first.usage.cache_read_input_tokens)


def test_greedy_text_equals_the_engine_and_the_stream_builds_the_same_message(daemon, client):
    entry = daemon.manager.get("tiny")
    prompt = "The router reads"
    prompt_ids = entry.runtime.encode_prompt(prompt, chat=True, system="Be brief.")
    handle = entry.loop.submit(GenerationRequest("direct", prompt_ids, SamplingParams(max_tokens=10)))
    events = list(handle.events(timeout=30))
    expected, reason = "".join(e.text for e in events), events[-1].finish_reason

    request = dict(model="tiny", max_tokens=10, **GREEDY, system="Be brief.",
                   messages=[{"role": "user", "content": prompt}])
    message = client.messages.create(**request)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    assert "".join(b.text for b in message.content if b.type == "text") == expected
    assert message.stop_reason == ("max_tokens" if reason == "length" else "end_turn")
    # the engine's run left the prompt's whole blocks in the prefix cache (all but the last token may be reused);
    # Anthropic counts them apart from input_tokens
    reused = (len(prompt_ids) - 1) // 16 * 16
    assert reused > 0 and message.usage.cache_read_input_tokens == reused
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt_ids)
    assert message.usage.output_tokens == events[-1].usage.completion_tokens
    assert message.usage.cache_creation_input_tokens == 0

    with client.messages.stream(**request) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_message()
    assert same_answer(streamed, message)


def test_text_answer_non_streamed_and_streamed(daemon, client):
    request = dict(**GREEDY, model="chat", max_tokens=100, system=[{"type": "text", "text": "You are terse."},
                                                         {"type": "text", "text": "Answer in English."}],
                   messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                   metadata={"user_id": "u-1"})
    message = client.messages.create(**request)
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == CHAT_ANSWERS["Hello"]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    prompt = daemon.chat.prompts[-1]
    assert prompt == ("<|im_start|>system\nYou are terse.\nAnswer in English.<|im_end|>\n"
                      "<|im_start|>user\nHello<|im_end|>\n" + GENERATION_PROMPT)
    tokenizer = daemon.chat.tokenizer
    assert message.usage.input_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert message.usage.output_tokens == len(tokenizer.encode(CHAT_ANSWERS["Hello"], add_special_tokens=False)) + 1

    with client.messages.stream(**request) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == CHAT_ANSWERS["Hello"] and len(texts) > 1
    assert same_answer(final, message)

    events = sse_events(daemon, request)
    assert check_block_order(events) == [{"type": "text", "text": ""}]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == message.usage.input_tokens
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == CHAT_ANSWERS["Hello"]
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == message.usage.output_tokens


def test_max_tokens_ends_with_stop_reason_max_tokens(client):
    count = [{"role": "user", "content": "Count"}]
    message = client.messages.create(**GREEDY, model="chat", max_tokens=3, messages=count)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert CHAT_ANSWERS["Count"].startswith(message.content[0].text)
    with client.messages.stream(**GREEDY, model="chat", max_tokens=3, messages=count) as s:
        assert s.get_final_message().stop_reason == "max_tokens"


def test_stop_sequences_end_with_the_one_that_matched(client):
    for stream in (False, True):
        kwargs = dict(**GREEDY, model="chat", max_tokens=50, messages=[{"role": "user", "content": "Count"}],
                      stop_sequences=["nine", "four", " three"])
        if stream:
            with client.messages.stream(**kwargs) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        # " three" completes before "four" does: the first stop to complete wins
        assert message.content[0].text == "one two"
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == " three"


def test_count_tokens_equals_the_input_tokens_of_the_messages_call(client):
    for model, extra in (("chat", {}), ("tools", {"tools": [WEATHER_TOOL]})):
        request = dict(model=model, system="Be brief.", messages=[{"role": "user", "content": "Hello"}], **extra)
        counted = client.messages.count_tokens(**request).input_tokens
        message = client.messages.create(max_tokens=5, **GREEDY, **request)
        assert counted == message.usage.input_tokens > 0
    without_tools = client.messages.count_tokens(model="tools", messages=[{"role": "user", "content": "Hello"}])
    with_tools = client.messages.count_tokens(model="tools", messages=[{"role": "user", "content": "Hello"}],
                                              tools=[WEATHER_TOOL])
    assert with_tools.input_tokens > without_tools.input_tokens


def test_pings_while_the_model_is_silent(daemon, monkeypatch):
    monkeypatch.setattr(anthropic_messages, "PING_INTERVAL_S", 0.05)
    events = sse_events(daemon, {"model": "slow", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]})
    names = [n for n, _ in events]
    first_block = names.index("content_block_start")
    assert "ping" in names[1:first_block], names  # each step takes 0.3 s: several intervals pass before a token
    check_block_order(events)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "Slow."


def test_a_client_that_leaves_mid_stream_cancels_the_request(daemon, client):
    loop = daemon.manager.get("slow").loop
    served = loop.requests_served
    # 500 tokens at 0.3 s a step: only a cancellation ends this within wait_idle's 30 s
    with client.messages.stream(**GREEDY, model="slow", max_tokens=500,
                                messages=[{"role": "user", "content": "Ramble"}]) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break
    daemon.wait_idle()
    assert loop.requests_served == served + 1 and loop.num_active == 0


def test_thinking_comes_back_as_a_thinking_block_before_the_text(daemon, client):
    request = dict(**GREEDY, model="chat", max_tokens=100, thinking={"type": "enabled", "budget_tokens": 1024},
                   messages=[{"role": "user", "content": "Think"}])
    message = client.messages.create(**request)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking.strip() == "The user wants a greeting." and message.content[0].signature
    assert message.content[1].text == "Hi!" and message.stop_reason == "end_turn"
    with client.messages.stream(**request) as stream:
        for _ in stream:
            pass
        assert same_answer(stream.get_final_message(), message)

    events = sse_events(daemon, request)
    assert [b["type"] for b in check_block_order(events)] == ["thinking", "text"]
    kinds = [d["delta"]["type"] for n, d in events if n == "content_block_delta" and d["index"] == 0]
    assert kinds[-1] == "signature_delta" and set(kinds[:-1]) == {"thinking_delta"}

    omitted = client.messages.create(**{**request, "thinking": {"type": "enabled", "budget_tokens": 1024,
                                                                 "display": "omitted"}})
    assert [b.type for b in omitted.content] == ["text"]

    # the thinking block goes back in the next turn (ChatML shows no reasoning: only the text renders)
    client.messages.create(**GREEDY, model="chat", max_tokens=5, messages=[
        {"role": "user", "content": "Think"},
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": "Hello"}])
    assert "<|im_start|>assistant\nHi!<|im_end|>\n<|im_start|>user\nHello<|im_end|>" in daemon.chat.prompts[-1]


def test_a_final_assistant_turn_is_continued(daemon, client):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello there,"}]
    counted = client.messages.count_tokens(model="chat", messages=messages).input_tokens
    expected = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHello there,"
    assert counted == len(daemon.chat.tokenizer.encode(expected, add_special_tokens=False))
    message = client.messages.create(**GREEDY, model="chat", max_tokens=5, messages=messages)
    assert message.usage.input_tokens == counted
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**GREEDY, model="chat", max_tokens=5, messages=[
            {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello there, "}])
    assert_anthropic_error(e, "invalid_request_error", "whitespace")


# ---- tools ------------------------------------------------------------------------------------

def test_tool_use_round_trip(daemon, client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = client.messages.create(**GREEDY, model="tools", max_tokens=200, tools=[WEATHER_TOOL], messages=messages)
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Let me check."
    call = message.content[1]
    assert call.name == "get_weather" and call.input == TOOL_ARGS and call.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    prompt = daemon.tools.prompts[-1]
    assert "# Tools" in prompt and json.dumps({"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER_TOOL["input_schema"],
        "description": WEATHER_TOOL["description"]}}) in prompt

    # the follow-up turn: the assistant's tool_use and the user's tool_result render through the template
    follow_up = messages + [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                            {"role": "user", "content": [
                                {"type": "tool_result", "tool_use_id": call.id,
                                 "content": [{"type": "text", "text": "18 degrees"}]},
                                {"type": "text", "text": "Answer briefly."}]}]
    answer = client.messages.create(**GREEDY, model="tools", max_tokens=200, tools=[WEATHER_TOOL], messages=follow_up)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == FINAL_ANSWER
    assert answer.stop_reason == "end_turn"
    prompt = daemon.tools.prompts[-1]
    assert ("<|im_start|>assistant\nLet me check.\n<tool_call>\n"
            + json.dumps({"name": "get_weather", "arguments": TOOL_ARGS}) + "\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>\n"
            "<|im_start|>user\nAnswer briefly.<|im_end|>\n" + GENERATION_PROMPT) in prompt


def test_streamed_tool_use_assembles_the_same_input(daemon, client):
    request = dict(**GREEDY, model="tools", max_tokens=200, tools=[WEATHER_TOOL],
                   messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    with client.messages.stream(**request) as stream:
        for _ in stream:
            pass
        final = stream.get_final_message()
    message = client.messages.create(**request)
    assert final.model_dump(exclude={"id"}, exclude_none=True)["content"][0] == message.content[0].model_dump(
        exclude_none=True)
    assert final.content[1].input == message.content[1].input == TOOL_ARGS
    assert final.stop_reason == "tool_use"

    events = sse_events(daemon, request)
    started = check_block_order(events)
    assert [b["type"] for b in started] == ["text", "tool_use"]
    assert started[1]["name"] == "get_weather" and started[1]["input"] == {}
    pieces = [d["delta"]["partial_json"] for n, d in events
              if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert pieces and json.loads("".join(pieces)) == TOOL_ARGS
    assert all(d["index"] == 1 for n, d in events if n == "content_block_delta"
               and d["delta"]["type"] == "input_json_delta")
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_none_renders_no_tools_and_parses_no_calls(daemon, client):
    message = client.messages.create(**GREEDY, model="tools", max_tokens=200, tools=[WEATHER_TOOL],
                                     tool_choice={"type": "none"},
                                     messages=[{"role": "user", "content": "What is the weather?"}])
    assert "# Tools" not in daemon.tools.prompts[-1]
    assert [b.type for b in message.content] == ["text"] and "<tool_call>" in message.content[0].text
    assert message.stop_reason == "end_turn"


# ---- bad requests -----------------------------------------------------------------------------

def assert_anthropic_error(exc_info, kind: str, *words: str) -> None:
    body = exc_info.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    for word in words:
        assert word in body["error"]["message"], body


def test_bad_requests_get_the_sdk_error_classes_with_anthropic_bodies(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": "chat", "messages": [{"role": "user", "content": "Hi"}]},
                    cast_to=object)
    assert_anthropic_error(e, "invalid_request_error", "max_tokens", "required")

    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(**GREEDY, model="no-such-model", max_tokens=5,
                               messages=[{"role": "user", "content": "Hi"}])
    assert_anthropic_error(e, "not_found_error", "no-such-model")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    assert_anthropic_error(e, "not_found_error", "no-such-model")

    with pytest.raises(anthropic.BadRequestError) as e:  # a streamed request fails before the stream starts
        with client.messages.stream(**GREEDY, model="chat", max_tokens=5, messages=[]):
            pass
    assert_anthropic_error(e, "invalid_request_error", "messages")

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**GREEDY, model="tools", max_tokens=5, tools=[WEATHER_TOOL], messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    assert_anthropic_error(e, "invalid_request_error", "toolu_nope", "tool_use")

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**GREEDY, model="chat", max_tokens=5, tools=[WEATHER_TOOL],
                               tool_choice={"type": "tool", "name": "nope"},
                               messages=[{"role": "user", "content": "Hi"}])
    assert_anthropic_error(e, "invalid_request_error", "nope", "get_weather")

    # an output budget over the context is not an error: generation ends where the context does (agents ask
    # for 32k tokens by default; llama-server clamps the same way)
    answer = client.messages.create(**GREEDY, model="chat", max_tokens=100_000, messages=[{"role": "user",
                                                                                         "content": "Hi"}])
    assert answer.stop_reason in ("end_turn", "max_tokens")


def test_a_prompt_over_the_context_is_reported_in_anthropics_words(client):
    """"prompt is too long: N tokens > M maximum" is what Claude Code recognises to compact the conversation."""
    long = [{"role": "user", "content": "word " * 1200}]
    n = client.messages.count_tokens(model="chat", messages=long).input_tokens
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**GREEDY, model="chat", max_tokens=5, messages=long, stream=stream)
        assert_anthropic_error(e, "invalid_request_error")
        assert re.match(rf"prompt is too long: {n} tokens > 1023 maximum", e.value.body["error"]["message"])


def test_malformed_bodies_get_anthropic_shaped_400s(daemon):
    user = [{"role": "user", "content": "x"}]
    shared = [  # bad for both endpoints
        b"{not json",
        b"[1, 2]",
        {"model": "chat", "messages": [{"role": "user", "content": 5}]},
        {"model": "chat", "messages": [{"role": "robot", "content": "x"}]},
        {"model": "chat", "messages": [{"role": "user", "content": [{"type": "video", "source": 5}, "x"]}]},
        {"model": "chat", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"model": "chat", "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "not an object"}]}]},
        {"model": "chat", "messages": user, "tools": [{"name": "web_search", "type": "web_search_20250305"}]},
        {"model": "chat", "messages": user, "system": [{"type": "image", "source": {}}]},
        {"model": "chat", "messages": user, "tool_choice": {"type": "any"}},
        {"model": "chat", "messages": user, "tool_choice": {"type": "sometimes"}},
        {"model": "chat", "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                     "input": {}}]}]},
    ]
    messages_only = [
        {"model": "chat", "max_tokens": 0, "messages": user},
        {"model": "chat", "max_tokens": 5, "temperature": -1, "messages": user},
        {"model": "chat", "max_tokens": 5, "top_p": 2, "messages": user},
        {"model": "chat", "max_tokens": "five", "messages": user},
    ]
    requests = [("/v1/messages/count_tokens", b) for b in shared] + [
        ("/v1/messages", b if isinstance(b, bytes) else {**b, "max_tokens": 5}) for b in shared] + [
        ("/v1/messages", b) for b in messages_only]
    for path, body in requests:
        status, answer = raw_post(daemon, path, body)
        assert status == 400, (path, body, answer)
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
        assert not re.search(r"list\[|tagged-union|\.str\b", answer["error"]["message"]), answer
    _, answer = raw_post(daemon, "/v1/messages", {"model": "chat", "max_tokens": 5, "messages": [
        {"role": "user", "content": 5}]})
    assert "'messages[0].content': must be a string or a list of content blocks" in answer["error"]["message"]
    # the fields count_tokens does not take are ignored there
    status, answer = raw_post(daemon, "/v1/messages/count_tokens", {**messages_only[1], "stream": True})
    assert status == 200 and answer["input_tokens"] > 0


def test_a_wrong_api_key_is_an_authentication_error(tmp_path):
    guarded = start_http_daemon(token="s3cret")
    try:
        with pytest.raises(anthropic.AuthenticationError) as e:
            guarded.anthropic(api_key="wrong").messages.create(model="x", max_tokens=5,
                                                               messages=[{"role": "user", "content": "Hi"}])
        assert_anthropic_error(e, "authentication_error", "token")
        with pytest.raises(anthropic.NotFoundError):  # the right key gets through to the model lookup
            guarded.anthropic().messages.create(model="x", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    finally:
        guarded.close()


# ---- units: the message mapping and the block builder -------------------------------------------

def test_messages_map_onto_chat_template_messages():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": "sys",
        "messages": [
            {"role": "user", "content": "first"},
            {"role": "user", "content": [{"type": "text", "text": "second"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should look it up.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xx"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "a"}},
                {"type": "tool_use", "id": "t2", "name": "read", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "found", "is_error": False},
                {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "no file"}],
                 "is_error": True},
                {"type": "text", "text": "go on"}]},
        ]})
    assert template_messages(body) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first\n\nsecond"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "I should look it up.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "search", "arguments": {"q": "a"}}},
            {"id": "t2", "type": "function", "function": {"name": "read", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "t1", "name": "search", "content": "found"},
        {"role": "tool", "tool_call_id": "t2", "name": "read", "content": "Error: no file"},
        {"role": "user", "content": "go on"},
    ]


class Ev:
    def __init__(self, kind, text="", tool_index=-1, name="", arguments_delta=""):
        self.kind, self.text, self.tool_index, self.name, self.arguments_delta = (kind, text, tool_index, name,
                                                                                  arguments_delta)


def test_block_builder_orders_blocks_and_closes_each_before_the_next():
    builder = BlockBuilder()
    events = []
    for ev in (Ev("reasoning", "Think"), Ev("reasoning", "ing."), Ev("text", "Answer:"), Ev("text", " yes\n\n"),
               Ev("tool_call", tool_index=0, name="f"), Ev("tool_call", tool_index=0, arguments_delta='{"a": '),
               Ev("tool_call", tool_index=0, arguments_delta="1}"), Ev("tool_call", tool_index=1, name="g"),
               Ev("text", "\n")):
        events += builder.add(ev)
    events += builder.finish()
    shape = [(n, d.get("index"), d.get("delta", d.get("content_block", {})).get("type")) for n, d in events]
    assert shape == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_stop", 3, None)]
    blocks = [b.model_dump() for b in builder.blocks]
    assert blocks[0]["thinking"] == "Thinking." and blocks[0]["signature"]
    assert events[3][1]["delta"]["signature"] == blocks[0]["signature"]
    assert blocks[1] == {"type": "text", "text": "Answer: yes"}  # the whitespace before the call is dropped
    assert blocks[2]["name"] == "f" and blocks[2]["input"] == {"a": 1}
    assert blocks[3]["name"] == "g" and blocks[3]["input"] == {}
    assert builder.has_tool_use


def test_block_builder_keeps_trailing_whitespace_of_a_text_answer_and_drops_parallel_calls():
    builder = BlockBuilder()
    for ev in (Ev("text", "\n"), Ev("text", "Hi \n")):
        builder.add(ev)
    builder.finish()
    assert [b.model_dump() for b in builder.blocks] == [{"type": "text", "text": "\nHi \n"}]

    single = BlockBuilder(single_tool=True)
    for ev in (Ev("tool_call", tool_index=0, name="f"), Ev("tool_call", tool_index=1, name="g"),
               Ev("tool_call", tool_index=1, arguments_delta="{}")):
        single.add(ev)
    single.finish()
    assert [b.name for b in single.blocks] == ["f"]


def test_validation_problems_lose_the_union_branch_noise():
    from pydantic import ValidationError

    try:
        MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text"}]}]})
    except ValidationError as exc:
        problems = _clean_problems(list(exc.errors()))
    assert [(p["loc"], p["type"]) for p in problems] == [(("messages", 0, "content", 1, "text"), "missing")]
    assert not any(re.search(r"list\[|tagged-union|\bstr\b", str(p["loc"])) for p in problems)
