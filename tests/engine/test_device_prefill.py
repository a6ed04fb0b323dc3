"""Through the engine: a prompt on a device-resident model prefills in device-sized steps, streams whole
expert layers, and generates what the CPU backend generates."""

from __future__ import annotations

import pytest

from helpers.tiny_models import build_tiny_model
from moed.config import EngineConfig
from moed.engine.engine_loop import (DEFAULT_MAX_STEP_TOKENS, DEFAULT_PREFILL_CHUNK, DEVICE_MAX_STEP_TOKENS,
                                     DEVICE_PREFILL_CHUNK, EngineLoop, step_sizes)
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    build_tiny_model("mixtral", path)
    return path


def test_step_sizes_follow_where_the_model_runs(model_dir):
    cpu = open_runtime(model_dir, engine=EngineConfig(device="cpu"))
    dev = open_runtime(model_dir, engine=EngineConfig(device="emulated", cache_fraction=1.0, emulated_b_p=50e9))
    try:
        assert step_sizes(cpu) == (DEFAULT_PREFILL_CHUNK, DEFAULT_MAX_STEP_TOKENS)
        assert step_sizes(dev) == (DEVICE_PREFILL_CHUNK, DEVICE_MAX_STEP_TOKENS)
        assert step_sizes(cpu, 4) == (DEFAULT_PREFILL_CHUNK, 4 * DEFAULT_PREFILL_CHUNK)
        loop = EngineLoop(dev, name="t", max_batch=2, context_length=128)
        assert loop._scheduler.prefill_chunk == DEVICE_PREFILL_CHUNK
    finally:
        cpu.close()
        dev.close()


@pytest.mark.parametrize("buffers", [2, 1])
def test_a_long_prompt_streams_its_layers_and_generates_the_cpu_backends_tokens(model_dir, buffers):
    prompt = [(7 * i + 11) % 400 + 20 for i in range(150)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)]
    cpu = open_runtime(model_dir, engine=EngineConfig(device="cpu"))
    try:
        (want,) = run_offline(cpu, [prompt], params, context_length=200)
    finally:
        cpu.close()
    dev = open_runtime(model_dir, engine=EngineConfig(device="emulated", cache_fraction=1.0, emulated_b_p=50e9,
                                                      prefill_buffers=buffers))
    try:
        (got,) = run_offline(dev, [prompt], params, context_length=200)
        stats = dev.executor.stats
    finally:
        dev.close()
    assert got.token_ids == want.token_ids
    moe_layers = dev.loaded.bank.num_moe_layers
    assert stats.streamed_layers == moe_layers  # one step for the whole prompt, every layer streamed
    assert stats.hits + stats.misses > 0  # then decode took the split policy again
