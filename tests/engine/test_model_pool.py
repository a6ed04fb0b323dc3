"""Models loaded when a request names them, unloaded when idle past their keep-alive or when another needs the room
(least recently used first, never a busy one), one load per model however many requests wait (issue #35)."""

from __future__ import annotations

import threading
import time

import pytest

from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.model_manager import LoadOptions, ModelManager
from moed.engine.model_pool import ModelPool, PoolConfig, parse_keep_alive
from moed.engine.request import GenerationRequest
from moed.engine.sampling import SamplingParams
from moed.errors import InsufficientMemoryError, InvalidRequestError, ServiceUnavailableError

OPTIONS = LoadOptions(device="cpu", context_length=256, kv_tokens=512)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, family in (("a", "qwen3_moe"), ("b", "mixtral")):
        build_tiny_model(family, root / name)
        write_tiny_tokenizer(root / name)
    return root


def _pool(models, **config) -> ModelPool:
    pool = ModelPool(ModelManager([models]), PoolConfig(options=OPTIONS, tick_s=0.02, **config))
    pool.start()
    return pool


def _close(pool: ModelPool) -> None:
    pool.stop()
    pool.manager.unload_all()


def _names(pool: ModelPool) -> set[str]:
    return {e.name for e in pool.manager.loaded()}


def _wait_for(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_request_loads_its_model_once_however_many_wait(models):
    pool = _pool(models)
    try:
        got, errors = [], []

        def ask():
            try:
                got.append(pool.acquire("a"))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(got) == 6 and len({id(e) for e in got}) == 1
        assert _names(pool) == {"a"}
        assert pool.expires_in("a") == pytest.approx(300, abs=5)  # the default keep-alive of on-demand loads
        with pytest.raises(InvalidRequestError, match="not found"):
            pool.acquire("no-such-model")
    finally:
        _close(pool)


def test_at_most_n_models_the_least_recently_used_idle_one_goes(models):
    pool = _pool(models, max_loaded=1)
    try:
        pool.acquire("a")
        pool.acquire("b")
        assert _names(pool) == {"b"}
        pool.acquire("a")
        assert _names(pool) == {"a"}
    finally:
        _close(pool)


def test_a_memory_budget_that_fits_one_model(models):
    probe = _pool(models)
    try:
        need = probe.used_bytes(probe.acquire("a"))
    finally:
        _close(probe)
    pool = _pool(models, memory_budget=int(need * 1.6))
    try:
        pool.acquire("a")
        pool.acquire("b")
        assert _names(pool) == {"b"}
        a = pool.acquire("a")
        assert _names(pool) == {"a"}
        # a busy model is never unloaded: with "a" generating, "b" does not fit and says so
        handle = a.loop.submit(GenerationRequest("long", a.runtime.tokenizer.encode("The router"),
                                                 SamplingParams(max_tokens=200, ignore_eos=True)))
        _wait_for(lambda: a.loop.num_active, "the request to run")
        with pytest.raises(InsufficientMemoryError):
            pool.acquire("b")
        handle.cancel()
        assert _names(pool) == {"a"}
    finally:
        _close(pool)


def test_keep_alive_zero_unloads_when_idle_and_a_duration_counts_from_the_last_request(models):
    pool = _pool(models, keep_alive_s=0.3)
    try:
        entry = pool.acquire("a")
        assert 0 < pool.expires_in("a") <= 0.3
        handle = entry.loop.submit(GenerationRequest("r", entry.runtime.tokenizer.encode("The router"),
                                                     SamplingParams(max_tokens=64, ignore_eos=True)))
        list(handle.events())
        _wait_for(lambda: "a" not in _names(pool), "the keep-alive to unload a")
        pool.acquire("b", keep_alive=None)  # forever
        assert pool.expires_in("b") is None
        time.sleep(0.5)
        assert _names(pool) == {"b"}
        pool.touch("b", 0, hold=False)  # a load-only request with keep_alive 0: unloaded at once
        _wait_for(lambda: not _names(pool), "keep_alive 0 to unload b")
    finally:
        _close(pool)


def test_a_load_longer_than_the_wait_is_a_503_with_retry_after_and_goes_on(models):
    pool = _pool(models, load_wait_s=0.0001)
    try:
        with pytest.raises(ServiceUnavailableError) as info:
            pool.acquire("a")
        assert info.value.retry_after >= 1 and "still loading" in str(info.value)
        _wait_for(lambda: "a" in _names(pool), "the load to finish anyway")
        assert pool.acquire("a").name == "a"
    finally:
        _close(pool)


@pytest.mark.parametrize("value, seconds", [("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0), ("0", 0.0), (0, 0.0),
                                            (45, 45.0), (-1, None), ("-1", None), ("-1m", None), ("1.5h", 5400.0)])
def test_keep_alive_values_as_ollama_takes_them(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", True, None, "5x", "nan", ""])
def test_bad_keep_alive_values_are_clear_errors(value):
    with pytest.raises(InvalidRequestError, match="keep_alive"):
        parse_keep_alive(value)


def test_loads_in_flight_report_their_progress(models):
    """What `moed ps`, the tray's status line and ListModels show while a model loads."""
    manager = ModelManager([models])
    seen = []
    manager.load("a", OPTIONS, progress=lambda stage, done, total: seen.append(manager.loading().get("a")))
    try:
        assert seen and all(s is not None for s in seen) and max(s[1] for s in seen) == pytest.approx(1.0)
        assert manager.loading() == {}
    finally:
        manager.unload_all()
