"""Issue #9's defects, reproduced against a real daemon: each answer is a clear error and the daemon keeps serving."""

from __future__ import annotations

import os
import shutil
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helpers.daemon_process import start_daemon
from helpers.tiny_models import build_tiny_model_dir
from moed.api.client import DaemonCallError

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models_dir):
    d = start_daemon(tmp_path_factory.mktemp("home"), "--model", "tiny", models_dir=models_dir)
    deadline = time.monotonic() + 60
    while d.health() != SERVING:  # the initial load
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield d
    assert d.stop() == 0, (d.home / "daemon.out").read_text()


def call_error(fn) -> DaemonCallError:
    with pytest.raises(DaemonCallError) as info:
        fn()
    return info.value


def greedy_text(client, prompt: str = "The router reads", **kw) -> str:
    parts = list(client.generate(prompt=prompt, model="tiny", max_tokens=8, ignore_eos=True, **kw))
    assert parts[-1].done
    return "".join(p.text for p in parts)


def test_a_fifo_weight_file_is_refused_and_never_freezes_the_daemon(daemon, models_dir, tmp_path):
    d = tmp_path / "fifo-model"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models_dir / "tiny" / name, d / name)
    os.mkfifo(d / "model.safetensors")
    result: dict = {}

    def load() -> None:
        with daemon.client() as client:
            try:
                list(client.load(str(d), name="fifo"))
            except DaemonCallError as exc:
                result["error"] = exc

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    # meanwhile (and whatever the load does) the daemon answers
    with daemon.client(timeout=5) as client:
        assert client.status().state in ("idle", "loading", "generating")
    loader.join(30)
    assert not loader.is_alive(), "LoadModel of a FIFO never returned"
    err = result["error"]
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "named pipe" in str(err)
    with daemon.client(timeout=5) as client:
        assert [m.name for m in client.list_models() if m.loaded] == ["tiny"]
        assert greedy_text(client)
    assert daemon.health() == SERVING


def test_two_concurrent_loads_of_one_name_give_one_model_and_already_exists(daemon):
    outcomes: list = []
    barrier = threading.Barrier(2)

    def load() -> None:
        with daemon.client() as client:
            barrier.wait(10)
            try:
                list(client.load("tiny", name="twin"))
                outcomes.append("ok")
            except DaemonCallError as exc:
                outcomes.append(exc.code)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(map(str, outcomes)) == sorted(["ok", str(grpc.StatusCode.ALREADY_EXISTS)]), outcomes
    with daemon.client() as client:
        assert [m.name for m in client.list_models() if m.loaded].count("twin") == 1
        client.unload("twin")


def test_a_kv_pool_larger_than_ram_is_refused_with_what_would_fit(daemon, models_dir, tmp_path):
    import json

    long = tmp_path / "long-context"
    shutil.copytree(models_dir / "tiny", long)
    config = json.loads((long / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 20
    (long / "config.json").write_text(json.dumps(config))
    with daemon.client() as client:
        # a pool of 256 contexts of 1M tokens: ~140 GB of KV on a 24 GB machine
        err = call_error(lambda: list(client.load(str(long), name="huge", max_batch=256, context_length=1 << 20,
                                                  kv_tokens=1 << 28)))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "KV pool" in str(err) and "would fit" in str(err)
        assert [m.name for m in client.list_models() if m.loaded] == ["tiny"]
        assert greedy_text(client)


def test_subnormal_sampling_values_sample(daemon):
    with daemon.client() as client:
        greedy = greedy_text(client)
        assert greedy_text(client, temperature=1e-40) == greedy, "a tiny temperature is greedy decoding"
        assert greedy_text(client, temperature=5e-324) == greedy
        assert greedy_text(client, temperature=0.8, repetition_penalty=1e-45, seed=1)
        assert "sampl" not in client.status().last_error and "probability" not in client.status().last_error


def test_context_length_one_is_refused_before_reading(daemon):
    with daemon.client() as client:
        before = client.status()
        err = call_error(lambda: list(client.load("tiny", name="short", context_length=1)))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "at least 2" in str(err)
        assert [m.name for m in client.list_models() if m.loaded] == ["tiny"]
        assert client.status().requests_served == before.requests_served


def test_unknown_roles_are_refused_naming_the_allowed_ones(daemon):
    with daemon.client() as client:
        for role in ("wizard", "USER", ""):
            err = call_error(lambda: list(client.generate(messages=[{"role": role, "content": "hi"}], model="tiny")))
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "system, user, assistant, tool" in str(err)


def test_errors_quote_a_bounded_part_of_huge_inputs(daemon):
    huge = "x" * 100_000
    with daemon.client() as client:
        err = call_error(lambda: list(client.generate(prompt="hi", model=huge)))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and len(str(err)) < 1000
        assert "characters" in str(err)
        err = call_error(lambda: list(client.load(huge)))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and len(str(err)) < 1000
        err = call_error(lambda: list(client.generate(prompt="hi", model="tiny", stop=[huge])))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and len(str(err)) < 1000
        assert greedy_text(client)
