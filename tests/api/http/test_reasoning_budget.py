"""Anthropic's thinking budget enforced (issue #34): a model that would reason for 60 tokens is cut at the budget by
the engine writing the family's closing tag for it, the reasoning comes back as a thinking block of at most that
many tokens and the answer goes on as text; without a budget (or with a larger one) the reasoning is whole."""

from __future__ import annotations

import pytest

from helpers.http_daemon import ChatScriptedModel, add_scripted_model, start_http_daemon, tools_tokenizer

REASONING = "step " * 60
ANSWER = f"<think>{REASONING}</think>The answer is 4."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_http_daemon()
    model = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("tok")), lambda prompt: ANSWER)
    add_scripted_model(d, "thinker", model)
    d.tokenizer = model.tokenizer
    yield d
    d.close()


def _blocks(done):
    thinking = "".join(b.thinking for b in done.content if b.type == "thinking")
    text = "".join(b.text for b in done.content if b.type == "text")
    return thinking, text


@pytest.mark.parametrize("budget", [8, 20])
def test_the_budget_ends_the_thinking_block(daemon, budget):
    client = daemon.anthropic()
    done = client.messages.create(model="thinker", max_tokens=200, messages=[{"role": "user", "content": "2+2?"}],
                                  thinking={"type": "enabled", "budget_tokens": budget})
    thinking, text = _blocks(done)
    assert 0 < len(daemon.tokenizer.encode(thinking, add_special_tokens=False)) <= budget + 1, thinking
    assert thinking.strip() and REASONING.startswith(thinking.strip()[:10])
    assert text  # the answer went on after the forced closing tag


def test_a_budget_larger_than_the_reasoning_changes_nothing(daemon):
    client = daemon.anthropic()
    ask = dict(model="thinker", max_tokens=200, messages=[{"role": "user", "content": "2+2?"}])
    free = client.messages.create(**ask)
    roomy = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1000})
    assert _blocks(free) == _blocks(roomy)
    assert _blocks(roomy)[0].strip() == REASONING.strip() and _blocks(roomy)[1].startswith("The answer is 4")
