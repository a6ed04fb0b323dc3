"""ModelManager: discovery, loading by name, the host-RAM check before a load, unloading."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import build_tiny_model_dir
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.model_manager import LoadOptions, ModelManager
from moed.errors import InsufficientMemoryError, InvalidRequestError
from moed.weights.model_loader import estimate_host_bytes


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("models"), "olmoe")


def test_load_by_name_then_unload(models):
    manager = ModelManager([models])
    assert [p.name for p in manager.discover()] == ["tiny"]
    entry = manager.load("tiny", LoadOptions(device="cpu"))
    try:
        assert manager.get().name == "tiny" and entry.host_bytes() > 0
        with pytest.raises(InvalidRequestError, match="already loaded"):
            manager.load("tiny", LoadOptions(device="cpu"))
    finally:
        assert manager.unload("tiny")
    with pytest.raises(InvalidRequestError, match="no model is loaded"):
        manager.get()


def test_a_model_that_does_not_fit_in_host_ram_is_refused_before_loading(models):
    need = estimate_host_bytes(models / "tiny")
    assert need > 0
    manager = ModelManager([models], host_ram_available=lambda: need // 2)
    with pytest.raises(InsufficientMemoryError, match="host RAM"):
        manager.load("tiny", LoadOptions(device="cpu"))
    assert not manager.loaded() and not manager.is_loading


def test_unknown_model_names_say_where_they_looked(models):
    with pytest.raises(InvalidRequestError, match=str(models)):
        ModelManager([models]).load("nope", LoadOptions())


def test_close_stops_a_load_in_flight_leaves_nothing_loaded_and_refuses_new_loads(models, tmp_path):
    import threading

    from moed.weights.converter import convert_model

    ftw = convert_model(models / "tiny", tmp_path / "tiny-ftw", experts_dtype="fp32")
    write_tiny_tokenizer(ftw)
    manager = ModelManager([tmp_path])
    reading, release = threading.Event(), threading.Event()
    outcome: dict = {}

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "reading":
            reading.set()
            release.wait(10)  # hold the load mid-read until close() has been called

    def load() -> None:
        try:
            outcome["entry"] = manager.load(str(ftw), LoadOptions(device="cpu"), progress=progress)
        except InvalidRequestError as exc:
            outcome["error"] = str(exc)

    loader = threading.Thread(target=load)
    loader.start()
    assert reading.wait(30), "the load never reported reading"
    closer = threading.Thread(target=manager.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() returned while a load was still running"
    release.set()
    closer.join(30)
    loader.join(30)
    assert not closer.is_alive() and not loader.is_alive()
    assert "shutting down" in outcome.get("error", ""), outcome
    assert manager.loaded() == [] and not manager.is_loading
    with pytest.raises(InvalidRequestError, match="shutting down"):
        manager.load(str(ftw), LoadOptions(device="cpu"))


def test_a_device_resident_model_splits_its_vram_weights_kv_in_use_experts_then_cached_prefixes(models):
    """With the model on the (emulated) device, `moed ps`'s device memory counts its weights and KV pool,
    and a VRAM budget goes to the weights, then the KV blocks in use (at least one context), then the
    expert cache, and last to the pool's other blocks (cached prefixes): the pool shrinks before the
    expert cache does, and grows back when the budget does."""
    manager = ModelManager([models])
    entry = manager.load("tiny", LoadOptions(device="emulated", cache_fraction=1.0, context_length=64, max_batch=2))
    try:
        stats, bank, loop, model = entry.stats, entry.runtime.loaded.bank, entry.loop, entry.runtime.model
        assert stats.model_device_bytes > 0 and model.device is entry.runtime.executor.device
        assert entry.vram_bytes() == stats.cache_bytes + stats.model_device_bytes
        per_block, per_expert = loop.kv_block_bytes(), bank.bytes_per_expert()
        weights = model.weight_device_bytes + loop.workspace_bytes()  # what the device share sets aside first
        assert loop.workspace_bytes() > 0
        full, floor = loop.kv_full_blocks, loop.kv_floor_blocks()
        assert (full, floor) == (8, 4)  # two contexts of 64 tokens; one context when idle

        def apply(budget):
            manager.apply_cache_budget(budget)
            loop.run_at_safe_point(lambda: None).result(timeout=30)  # the resizes have been applied
            return loop.kv_num_blocks, stats.cache_slots

        everything = weights + full * per_block + bank.nbytes()
        assert apply(everything) == (full, bank.num_slots)
        assert apply(everything - per_block) == (full - 1, bank.num_slots)  # a cached-prefix block gives way
        assert apply(weights + floor * per_block + bank.nbytes()) == (floor, bank.num_slots)
        assert apply(weights + floor * per_block + 3 * per_expert + per_expert // 2) == (floor, 3)
        assert apply(weights) == (floor, 0)  # the KV in use is never given up
        assert stats.model_device_bytes == model.weight_device_bytes + floor * per_block
        assert apply(None) == (full, bank.num_slots)
        assert stats.model_device_bytes == model.weight_device_bytes + full * per_block
    finally:
        manager.unload("tiny")


def test_a_device_resident_model_keeps_no_host_copy_of_its_weights(models, monkeypatch):
    """After the weights move to the device, the loaded model refers to the device copies only (on a GPU
    host RAM would otherwise hold them twice), and host memory reported is the expert bank alone."""
    from moed.devices.emulated import EmulatedDevice

    adopted: dict[int, torch.Tensor] = {}
    plain_adopt = EmulatedDevice.adopt

    def copying_adopt(self, tensor):  # as CUDA does: a new tensor, the host one left behind
        moved = plain_adopt(self, tensor.clone())
        adopted[id(moved)] = moved
        return moved

    monkeypatch.setattr(EmulatedDevice, "adopt", copying_adopt)
    manager = ModelManager([models])
    entry = manager.load("tiny", LoadOptions(device="emulated", cache_fraction=0.5, context_length=64, max_batch=1))
    try:
        weights = entry.runtime.loaded.weights
        assert weights and all(id(w) in adopted for w in weights.values()), "host copies still referenced"
        assert entry.host_bytes() == entry.runtime.loaded.bank.nbytes()
    finally:
        manager.unload("tiny")
    cpu = manager.load("tiny", LoadOptions(device="cpu"))
    try:
        assert cpu.host_bytes() > cpu.runtime.loaded.bank.nbytes()  # on the host the weights count there
    finally:
        manager.unload("tiny")
