"""Load on demand over HTTP (issue #35): a request naming a model that is not loaded loads it; with a memory budget
that fits one model, two models requested alternately are each served (the other unloaded); requests that
arrive during a load wait for that one load; past the bounded wait a 503 with Retry-After; keep_alive 0 unloads
at once."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from helpers.http_daemon import start_http_daemon
from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.model_manager import LoadOptions, ModelManager
from moed.engine.model_pool import ModelPool, PoolConfig

OPTIONS = LoadOptions(device="cpu", max_batch=4, context_length=256, kv_tokens=512)
ASK = [{"role": "user", "content": "The router reads"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, family in (("a", "qwen3_moe"), ("b", "mixtral")):
        build_tiny_model(family, root / name)
        write_tiny_tokenizer(root / name)
    probe = ModelPool(ModelManager([root]), PoolConfig(options=OPTIONS))
    need = probe.used_bytes(probe.acquire("a"))
    probe.manager.unload_all()
    return root, need


def _loaded(d) -> set[str]:
    return {e.name for e in d.manager.loaded()}


def test_two_models_alternately_with_room_for_one(models):
    root, need = models
    d = start_http_daemon(root, options=OPTIONS, pool=PoolConfig(memory_budget=int(need * 1.6)))
    try:
        client = d.openai()
        for model in ("a", "b", "a", "b"):
            done = client.chat.completions.create(model=model, messages=ASK, max_tokens=3)
            assert done.model == model and done.choices[0].message.content is not None
            assert _loaded(d) == {model}, (model, _loaded(d))
        ollama = d.ollama()
        assert ollama.generate(model="a", prompt="The router", options={"num_predict": 2}).done
        assert _loaded(d) == {"a"}
        ollama.chat(model="a", messages=ASK, options={"num_predict": 2}, keep_alive=0)
        deadline = time.monotonic() + 10
        while _loaded(d):
            assert time.monotonic() < deadline, "keep_alive 0 did not unload"
            time.sleep(0.02)
    finally:
        d.close()


def test_requests_during_a_load_share_it_and_a_bounded_wait_answers_503(models):
    root, _ = models
    d = start_http_daemon(root, options=OPTIONS, pool=PoolConfig())
    try:
        results = []

        def ask():
            with httpx.Client(timeout=60) as http:
                results.append(http.post(f"{d.url}/v1/chat/completions",
                                         json={"model": "b", "messages": ASK, "max_tokens": 2}).status_code)

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [200] * 4 and _loaded(d) == {"b"}
    finally:
        d.close()
    d = start_http_daemon(root, options=OPTIONS, pool=PoolConfig(load_wait_s=0.001))
    try:
        slow = httpx.post(f"{d.url}/v1/chat/completions", json={"model": "a", "messages": ASK, "max_tokens": 2},
                          timeout=60)
        assert slow.status_code == 503 and int(slow.headers["retry-after"]) >= 1
        assert "still loading" in slow.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while "a" not in _loaded(d):  # the load went on
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert httpx.post(f"{d.url}/v1/chat/completions", json={"model": "a", "messages": ASK, "max_tokens": 2},
                          timeout=60).status_code == 200
        missing = httpx.post(f"{d.url}/v1/chat/completions", json={"model": "zz", "messages": ASK}, timeout=60)
        assert missing.status_code == 404 and "not found" in missing.json()["error"]["message"]
    finally:
        d.close()
