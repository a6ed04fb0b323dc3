"""EngineBridge: model names, raw decoding for the parsers, stop strings, cancellation (no HTTP in between)."""

from __future__ import annotations

import asyncio

import pytest

from helpers.http_daemon import EOS, ChatScriptedModel, add_scripted_model, start_http_daemon, tools_tokenizer
from moed.api.http.bridge import EngineBridge
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError, ModelNotFoundError, ServiceUnavailableError

# "<|im_start|>" is a special token of the tiny tokenizer: the engine's text drops it, raw text keeps it
ANSWER = "Before<|im_start|>after the marker, then more words"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture()
def daemon(tmp_path):
    d = start_http_daemon()
    d.model = ChatScriptedModel(tools_tokenizer(tmp_path / "tok"), lambda prompt: ANSWER)
    d.entry = add_scripted_model(d, "one", d.model)
    yield d
    d.close()


def run(bridge: EngineBridge, entry, params: SamplingParams, *, raw: bool, stop_after: int | None = None):
    """Texts of every event, and the done event (None when the consumer left early)."""

    async def go():
        stream = bridge.open_stream(entry, bridge.render_chat(entry, HI), params, raw=raw)
        texts, done = [], None
        async for event in stream.events():
            texts.append(event.text)
            done = event if event.done else None
            if stop_after is not None and len(texts) >= stop_after:
                break
        return texts, done

    return asyncio.run(go())


def test_raw_text_keeps_special_tokens_but_not_eos(daemon):
    bridge = EngineBridge(daemon.ctx)
    texts, done = run(bridge, daemon.entry, SamplingParams(max_tokens=100), raw=True)
    assert "".join(texts) == ANSWER
    assert done.finish_reason == "eos"
    plain, _ = run(bridge, daemon.entry, SamplingParams(max_tokens=100), raw=False)
    assert "".join(plain) == ANSWER.replace("<|im_start|>", "")
    assert daemon.model.tokenizer.decode([EOS], skip_special_tokens=False) not in "".join(texts)


def test_raw_text_applies_stop_strings_too(daemon):
    bridge = EngineBridge(daemon.ctx)
    texts, done = run(bridge, daemon.entry, SamplingParams(max_tokens=100, stop=("marker",)), raw=True)
    assert "".join(texts) == "Before<|im_start|>after the "
    assert done.finish_reason == "stop"
    # a stop string that only the raw text holds (it spans the special token) ends the request as well
    texts, done = run(bridge, daemon.entry, SamplingParams(max_tokens=100, stop=("e<|im_start|>a",)), raw=True)
    assert "".join(texts) == "Befor"
    assert done.finish_reason == "stop"
    daemon.wait_idle()


def test_leaving_the_iteration_cancels_the_request(daemon):
    bridge = EngineBridge(daemon.ctx)
    daemon.model.step_delay_s = 0.01
    texts, done = run(bridge, daemon.entry, SamplingParams(max_tokens=200, ignore_eos=True), raw=False,
                      stop_after=3)
    assert done is None and len(texts) == 3
    daemon.wait_idle()
    assert daemon.model.num_forwards < 150  # cancelled: far from the 200 tokens it was asked for


def test_model_names(daemon):
    bridge = EngineBridge(daemon.ctx)
    assert bridge.resolve("one") is daemon.entry
    assert bridge.resolve("") is daemon.entry and bridge.resolve("default") is daemon.entry
    with pytest.raises(ModelNotFoundError, match=r"'two' is not loaded \(loaded: one\)"):
        bridge.resolve("two")
    add_scripted_model(daemon, "two", ChatScriptedModel(daemon.model.tokenizer, lambda p: "x"))
    assert bridge.resolve("two").name == "two"
    with pytest.raises(InvalidRequestError, match=r"several models are loaded \(one, two\)"):
        bridge.resolve("default")
    assert [m.name for m in bridge.models()] == ["one", "two"]
    assert bridge.models()[0].context_length == 1024 and bridge.models()[0].family == "qwen3_moe"


def test_paused_stopping_and_empty_daemons(daemon):
    bridge = EngineBridge(daemon.ctx)
    daemon.ctx.paused = True
    with pytest.raises(ServiceUnavailableError, match="paused"):
        bridge.resolve("one")
    daemon.ctx.paused = False
    daemon.manager.unload("one")
    with pytest.raises(ModelNotFoundError, match="no model is loaded"):
        bridge.resolve("")


def test_the_default_output_budget_is_the_rest_of_the_context(daemon):
    bridge = EngineBridge(daemon.ctx)
    prompt = bridge.render_chat(daemon.entry, HI)
    assert bridge.default_max_tokens(daemon.entry, prompt) == 1024 - len(prompt)
    assert bridge.count_tokens(daemon.entry, HI) == len(prompt)
