"""Unload gives back what load took: device bytes and pinned host bytes return to their starting values.

The emulated device keeps a process-wide ledger of its slot memory (``emulated_device_bytes``, the
twin of ``torch.cuda.memory_allocated``) and books the bank's pinning through the same ledger a
CUDA registration uses (``pinned_bytes_now``); on a CUDA machine the same loop runs on the GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

from helpers.tiny_models import build_tiny_model
from moed.config import EngineConfig
from moed.devices.emulated import emulated_device_bytes
from moed.devices.pinning import pinned_bytes_now
from moed.engine.runtime import open_runtime
from moed.runner.forward_batch import ForwardBatch

RELOADS = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny_model("qwen3_moe", path)
    return path


def _decode_a_little(runtime) -> None:
    cache = runtime.model.new_cache(1, 32)
    logits = runtime.model.forward(ForwardBatch.from_token_lists([[5, 9, 11]], [0], [0]), cache)
    runtime.model.forward(ForwardBatch.from_token_lists([[int(logits.argmax(-1)[0])]], [3], [0]), cache)


def _reload_loop(model_dir, device: str, device_bytes, watch=None) -> list[int]:
    """``device_bytes()``: the device memory the process holds. Devices that earlier tests left to the
    garbage collector may be collected meanwhile, so it must come back to its start or below; each
    load's own device comes back to exactly zero."""
    gc.collect()
    start_device, start_pinned = device_bytes(), pinned_bytes_now()
    watched = []  # watch() after each unload
    for i in range(RELOADS):
        runtime = open_runtime(model_dir, engine=EngineConfig(device=device, cache_fraction=0.5, emulated_b_p=50e9))
        dev = runtime.executor.device
        try:
            assert runtime.executor.stats.cache_slots > 0
            assert device_bytes() > start_device, f"load {i}: no device memory taken"
            assert pinned_bytes_now() - start_pinned == runtime.executor.stats.pinned_bytes > 0, f"load {i}"
            _decode_a_little(runtime)
        finally:
            runtime.close()
        del runtime
        gc.collect()
        if device == "emulated":
            assert dev._ledger.allocated == 0, f"unload {i}: the device still holds {dev._ledger.allocated} bytes"
        if i == 0 and device == "cuda":
            # the first load's kernels made torch's own per-process CUDA state (cuBLASLt keeps its workspace
            # in torch's allocator: a 2 MiB segment stayed on an H200); it is not moed's and stays: count
            # from here
            start_device = max(start_device, device_bytes())
        if watch is not None:
            watched.append(watch())
        assert device_bytes() <= start_device, f"unload {i}: {device_bytes() - start_device} device bytes kept"
        assert pinned_bytes_now() == start_pinned, f"unload {i}: {pinned_bytes_now() - start_pinned} bytes still pinned"
        del dev
    return watched


def test_twenty_loads_and_unloads_on_the_emulated_device_leave_nothing_behind(model_dir):
    _reload_loop(model_dir, "emulated", emulated_device_bytes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_twenty_loads_and_unloads_on_cuda_leave_nothing_behind(model_dir):
    torch.cuda.empty_cache()  # start from no cached blocks: unload must give back the VRAM it reserved too
    # live bytes: every load takes some (the tiny model's slots can fit in a segment torch already holds, so
    # the reserved figure need not grow) and every unload gives all of them back ...
    reserved = _reload_loop(model_dir, "cuda", torch.cuda.memory_allocated, watch=torch.cuda.memory_reserved)
    # ... and the VRAM reserved for them is handed back to the driver, never more kept than after the first
    assert max(reserved) <= reserved[0], f"reserved VRAM after each unload: {reserved}"
