"""LiveRequest (engine/live_request.py): one request's sampling, streaming and final event, without a loop."""

from __future__ import annotations

import queue

import pytest
import torch

from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.live_request import LiveRequest
from moed.engine.request import GenerationRequest, RequestHandle
from moed.engine.sampling import SamplingParams
from moed.text.tokenizer import Tokenizer

EOS = 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(root)
    return Tokenizer(root)


def _live(tokenizer, **params) -> LiveRequest:
    params.setdefault("temperature", 0.0)
    request = GenerationRequest("r1", tokenizer.encode("hello"), SamplingParams(**params))
    return LiveRequest.create(request, RequestHandle("r1", lambda _: True), tokenizer)


def _one_hot(token: int, vocab: int) -> torch.Tensor:
    logits = torch.zeros(vocab)
    logits[token] = 10.0
    return logits


def _events(live: LiveRequest) -> list:
    out = []
    while True:
        try:
            out.append(live.handle._events.get_nowait())  # noqa: SLF001 - what the loop pushed
        except queue.Empty:
            return out


def test_each_token_is_streamed_and_the_reasons_to_stop_are_told(tokenizer):
    vocab = tokenizer.vocab_size
    word = tokenizer.encode(" world", add_special_tokens=False)
    live = _live(tokenizer, max_tokens=10)
    for t in word:
        assert live.accept(_one_hot(t, vocab), 10, frozenset({EOS}), 100) == (t, "")
    assert live.accept(_one_hot(EOS, vocab), 10, frozenset({EOS}), 100) == (EOS, "eos")
    done = live.done_event("eos")
    streamed = _events(live)
    assert "".join(e.text for e in streamed) + done.text == " world"
    assert done.done and done.finish_reason == "eos" and done.usage.completion_tokens == len(word) + 1
    assert done.usage.prompt_tokens == len(tokenizer.encode("hello"))

    live = _live(tokenizer, max_tokens=2)
    assert live.accept(_one_hot(word[0], vocab), 5, frozenset(), 100)[1] == ""
    assert live.accept(_one_hot(word[0], vocab), 6, frozenset(), 100)[1] == "length"
    live = _live(tokenizer, max_tokens=50)
    assert live.accept(_one_hot(word[0], vocab), 99, frozenset(), 100)[1] == "context"  # the context is full
    live = _live(tokenizer, max_tokens=50, ignore_eos=True)
    assert live.accept(_one_hot(EOS, vocab), 5, frozenset({EOS}), 100)[1] == ""  # ignore_eos: on it goes


def test_a_stop_string_ends_the_request_and_is_not_streamed(tokenizer):
    vocab = tokenizer.vocab_size
    live = _live(tokenizer, max_tokens=20, stop=("wor",))
    reasons = [live.accept(_one_hot(t, vocab), 5, frozenset(), 100)[1]
               for t in tokenizer.encode(" hello world", add_special_tokens=False)]
    assert "stop" in reasons
    text = "".join(e.text for e in _events(live)) + live.done_event("stop").text
    assert "wor" not in text and text.startswith(" hello")


def test_a_failed_request_sends_no_held_back_text(tokenizer):
    live = _live(tokenizer, max_tokens=20)
    done = live.done_event("error", "model step failed: boom")
    assert done.finish_reason == "error" and done.error == "model step failed: boom" and done.text == ""
    assert done.usage.completion_tokens == 0 and done.usage.ttft_s == 0.0
