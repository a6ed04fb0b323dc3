"""n > 1 choices (issue #34): chat and completions answer n choices of one prompt, sampled independently (a seed
moves on by the choice's index), and the prompt is prefilled once: the other choices find it in the prefix
cache (usage's cached tokens, summed over the choices)."""

from __future__ import annotations

import openai
import pytest

PROMPT_TEXT = "The router reads the weights quickly and the daemon streams many bytes again. " * 3


def test_chat_n4_prefills_the_prompt_once(client):
    messages = [{"role": "user", "content": PROMPT_TEXT + "Go on."}]
    done = client.chat.completions.create(model="tiny", messages=messages, n=4, temperature=1.0, seed=3,
                                          max_tokens=12)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in done.choices}) > 1  # sampled independently
    prompt = done.usage.prompt_tokens
    block = 16  # the KV block size: the prompt's last partial block is computed again by each choice
    assert done.usage.prompt_tokens_details.cached_tokens >= 3 * (prompt - block), done.usage
    assert 4 <= done.usage.completion_tokens <= 4 * 12  # every choice's output, the prompt once
    assert done.usage.total_tokens == prompt + done.usage.completion_tokens
    again = client.chat.completions.create(model="tiny", messages=messages, n=4, temperature=1.0, seed=3,
                                           max_tokens=12)
    assert [c.message.content for c in again.choices] == [c.message.content for c in done.choices]  # seeded


def test_completions_n3_and_greedy_choices_agree(client):
    done = client.completions.create(model="tiny", prompt=PROMPT_TEXT, n=3, temperature=0, max_tokens=8)
    assert len(done.choices) == 3 and len({c.text for c in done.choices}) == 1
    assert done.usage.completion_tokens == 3 * 8
    sampled = client.completions.create(model="tiny", prompt=PROMPT_TEXT, n=3, temperature=1.0, seed=1, max_tokens=8,
                                        logprobs=2)
    assert all(len(c.logprobs.tokens) == 8 for c in sampled.choices)


def test_streamed_chat_n3_interleaves_the_choices_and_equals_the_whole_answer(client):
    """OpenAI's streamed n: each chunk names its choice; every choice gets its role, deltas and finish reason; the
    text of each equals the non-streamed answer with the same seed, and the usage counts the prompt once."""
    messages = [{"role": "user", "content": PROMPT_TEXT + "Go on."}]
    kw = dict(model="tiny", messages=messages, n=3, temperature=1.0, seed=5, max_tokens=10)
    whole = client.chat.completions.create(**kw)
    texts, roles, reasons, usage = {}, {}, {}, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            roles[choice.index] = roles.get(choice.index) or choice.delta.role
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert sorted(texts) == [0, 1, 2] and all(roles[i] == "assistant" and reasons[i] for i in range(3))
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 2 * (usage.prompt_tokens - 16), usage


def test_streamed_completions_n3_equal_the_whole_answer(client):
    kw = dict(model="tiny", prompt=PROMPT_TEXT, n=3, temperature=1.0, seed=9, max_tokens=8)
    whole = client.completions.create(**kw)
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices] and all(reasons.values())
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_too_many_choices_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=17)
    assert "n=" in str(err.value)
