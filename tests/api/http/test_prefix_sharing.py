"""A request that shares a prefix with one still running, or just cancelled, reuses its prefilled blocks.

Agents abort streams (the user presses Esc) and send the next request at once, and run parallel requests
over one prefix (subagents, title and summary calls): the prompt blocks of a running request are in the
prefix cache as soon as they are prefilled (KVManager.publish), not only when it ends.
"""

from __future__ import annotations

import threading
import time

import pytest

from helpers.http_daemon import ChatScriptedModel, add_scripted_model, start_http_daemon, tools_tokenizer
from helpers.tiny_tokenizer import CHATML_TEMPLATE

LONG_ANSWER = "word " * 400  # decodes for a while at the scripted model's step delay


def first_token(stream) -> None:
    """Read a stream until its first generated text: the prompt has been prefilled."""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = start_http_daemon()
    model = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("tok"), CHATML_TEMPLATE),
                              lambda prompt: LONG_ANSWER, family="mixtral", step_delay_s=0.01)
    entry = add_scripted_model(d, "m", model, context_length=4096)
    yield d, entry
    d.close()


def _conversation(tag: str) -> list[dict]:
    text = " ".join(f"line {i} of the shared project notes for {tag}." for i in range(70))
    return [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": text}]


def test_a_request_sharing_a_prefix_with_one_still_decoding_reuses_it(served):
    daemon, entry = served
    client = daemon.openai()
    messages = _conversation("decoding")
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=400, stream=True)
    first_token(first)  # the first request has prefilled and is decoding now
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    prompt = second.usage.prompt_tokens
    assert prompt >= 2000
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.99 * prompt
    assert entry.loop.num_active >= 1  # the first one was still running
    first.close()
    daemon.wait_idle()


def test_a_request_right_after_a_cancelled_one_reuses_its_prefix(served):
    daemon, _ = served
    client = daemon.openai()
    messages = _conversation("cancelled")
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=400, stream=True)
    first_token(first)
    first.close()  # the client stops reading; the next request goes out at once
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.99 * second.usage.prompt_tokens
    daemon.wait_idle()


def test_parallel_requests_over_one_prefix_all_finish_and_the_later_ones_reuse_it(served):
    daemon, _ = served
    client = daemon.openai()
    messages = _conversation("parallel")
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=60, stream=True)
    first_token(first)
    results = []

    def ask(i: int) -> None:
        tail = [{"role": "user", "content": f"subtask {i}"}]
        results.append(client.chat.completions.create(model="m", messages=messages + tail, max_tokens=3))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    rest = "".join(chunk.choices[0].delta.content or "" for chunk in first if chunk.choices)
    assert rest.strip()
    assert len(results) == 3 and all(r.usage.prompt_tokens_details.cached_tokens >= 2000 for r in results)
    time.sleep(0.05)
    daemon.wait_idle()
