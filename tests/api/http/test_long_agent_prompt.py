"""With default settings (no --context) a 48k-token agent prompt is accepted on a model whose KV fits it."""

from __future__ import annotations

import openai
import pytest

from helpers.http_daemon import start_http_daemon
from helpers.tiny_models import build_tiny_model, tiny_config
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.model_manager import LoadOptions


@pytest.fixture(scope="module")
def long_daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    config = tiny_config("mixtral")
    config.max_position_embeddings = 65536
    build_tiny_model("mixtral", root / "long", config=config)
    write_tiny_tokenizer(root / "long")
    d = start_http_daemon(root, models=("long",), options=LoadOptions(device="cpu", max_batch=2))  # no context given
    yield d
    d.close()


def test_a_48k_token_prompt_is_accepted_and_an_over_long_one_gets_each_apis_error(long_daemon):
    entry = long_daemon.manager.get("long")
    assert entry.loop.context_length == 65536  # the model's own limit: its KV pool fits easily
    client = long_daemon.openai(timeout=600)
    text = "The router reads a small expert. " * 6000
    n = client.chat.completions.create(model="long", messages=[{"role": "user", "content": text}],
                                       max_tokens=1).usage.prompt_tokens
    assert n >= 48_000
    too_long = "The router reads a small expert. " * 9000
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="long", messages=[{"role": "user", "content": too_long}], max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded"
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as err:
        long_daemon.anthropic().messages.create(model="long", max_tokens=5,
                                                messages=[{"role": "user", "content": too_long}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith("prompt is too long: ")
