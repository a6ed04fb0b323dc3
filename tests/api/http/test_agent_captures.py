"""Requests the real agents sent, replayed: every shape in agent_captures is answered, and answered right.

The captures were recorded with scripts/record_agent_requests.py from Claude Code 2.1.197, Codex 0.171.0
and opencode 1.18.33 (the sessions of test_real_agents.py: each agent's first request and the one that
carries the tool result), secrets removed. They hold what the agents really send: Claude Code's
system-role entry inside ``messages``, its billing-header block, ``thinking: adaptive``,
``context_management``, ``cache_control`` and beta headers; Codex's developer messages, a ``namespace``
tool and the hosted ``web_search`` tool, ``reasoning`` and ``include``; opencode's chat completions with
``stream_options``. Replayed against a scripted model behind a ChatML template without tool syntax (the
generic tool format), every one must stream to its API's last event.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from helpers.http_daemon import ChatScriptedModel, add_scripted_model, start_http_daemon, tools_tokenizer
from helpers.tiny_tokenizer import CHATML_TEMPLATE

CAPTURES = sorted((Path(__file__).parent / "agent_captures").glob("*.json"))
SECRET = "the-file-says-7419"  # the file the agents read in the recorded sessions
CONTEXT = 196608
LAST_EVENT = {"/v1/messages": "event: message_stop", "/v1/responses": "event: response.completed",
              "/v1/chat/completions": "data: [DONE]"}


def answer(prompt: str) -> str:
    if SECRET in prompt:
        return "It says " + SECRET
    if "# Tools" in prompt:
        return '<tool_call>\n{"name": "Read", "arguments": {"file_path": "hello.txt"}}\n</tool_call>'
    return "Hi."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import dataclasses

    d = start_http_daemon()
    model = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("tok"), CHATML_TEMPLATE), answer,
                              family="mixtral")
    model.config = dataclasses.replace(model.config, max_position_embeddings=CONTEXT)
    add_scripted_model(d, "agent-model", model, context_length=CONTEXT)
    yield d, model
    d.close()


def replay(daemon, capture: dict) -> tuple[int, str]:
    body = dict(capture["body"], model="agent-model")
    headers = {k: v for k, v in capture["headers"].items() if k in ("anthropic-version", "anthropic-beta", "x-app")}
    request = urllib.request.Request(daemon.url + capture["path"], data=json.dumps(body).encode(), method="POST",
                                     headers={**headers, "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_captures_cover_each_agent_and_a_tool_result():
    names = [p.name for p in CAPTURES]
    for agent in ("claude", "codex", "opencode"):
        assert sum(n.startswith(agent) for n in names) >= 2, names
    assert sum(SECRET in p.read_text() for p in CAPTURES) >= 3  # one second turn per agent


@pytest.mark.parametrize("path", CAPTURES, ids=[p.stem for p in CAPTURES])
def test_a_captured_agent_request_is_answered_to_the_end(served, path):
    daemon, model = served
    capture = json.loads(path.read_text())
    seen = len(model.prompts)
    status, text = replay(daemon, capture)
    assert status == 200, text[:2000]
    assert LAST_EVENT[capture["path"].split("?")[0]] in text, text[-2000:]
    assert "event: error" not in text and '"type":"response.failed"' not in text
    prompt = model.prompts[seen]
    assert "x-anthropic-billing-header" not in prompt  # removed: it differs in every request
    assert "<|im_start|>system" not in prompt[1:]  # one system turn, first: later ones were folded
    if SECRET in path.read_text():  # a second turn: the tool's result is in a <tool_response> block
        assert SECRET in prompt.split("<tool_response>", 1)[1]


def test_claude_codes_mid_conversation_system_entry_lands_in_a_user_turn(served):
    daemon, model = served
    capture = json.loads(next(p for p in CAPTURES if p.name.startswith("claude")).read_text())
    entry = next(m for m in capture["body"]["messages"] if m["role"] == "system")
    text = entry["content"] if isinstance(entry["content"], str) else entry["content"][0]["text"]
    seen = len(model.prompts)
    assert replay(daemon, capture)[0] == 200
    prompt = model.prompts[seen]
    head = text.strip().splitlines()[0]
    user_turns = prompt.split("<|im_start|>user\n")[1:]
    assert any(head in turn for turn in user_turns)


def _usage(stream_text: str) -> dict:
    """The cumulative usage of an Anthropic stream's message_delta event."""
    for line in stream_text.splitlines():
        if line.startswith("data: ") and '"message_delta"' in line:
            return json.loads(line[6:])["usage"]
    raise AssertionError("no message_delta in the stream")


@pytest.mark.parametrize("attribution", [True, False], ids=["billing-header-on", "CLAUDE_CODE_ATTRIBUTION_HEADER=0"])
def test_the_second_claude_code_request_of_a_session_prefills_only_its_new_tokens(served, attribution):
    daemon, _ = served
    daemon.manager.get("agent-model").loop.run_at_safe_point(
        lambda: daemon.manager.get("agent-model").loop._kv.clear_cache()).result()  # noqa: SLF001 - a cold start
    first, second = (json.loads(p.read_text()) for p in CAPTURES if p.name.startswith("claude"))
    for n, capture in enumerate((first, second)):
        system = capture["body"]["system"]
        assert not system[0]["text"].startswith("x-anthropic-billing-header")  # recorded after `moed launch`
        if attribution:  # what Claude Code sends without CLAUDE_CODE_ATTRIBUTION_HEADER=0: new values each time
            header = f"x-anthropic-billing-header: cc_version=2.1.197.{n}f6; cc_entrypoint=sdk-cli; cch={n}a{n}b7;"
            capture["body"]["system"] = [{"type": "text", "text": header}, *system]
    status, text = replay(daemon, first)
    assert status == 200
    shared = _usage(text)["input_tokens"] + _usage(text)["cache_read_input_tokens"]
    status, text = replay(daemon, second)
    usage = _usage(text)
    assert status == 200 and usage["cache_read_input_tokens"] >= 0.99 * shared, usage
