"""The native decode chain (models/decode_chain.py, native/cpu/decode_chain.c) gives the Python decode
path's numbers bit for bit: logits (its final norm and lm_head included), KV cache, expert counts, on every family and weight kind it
takes (bf16, q8 and GGUF-type packed projections, f32 and bf16 routers, biases, sinks, windows,
per-head q/k norms, dense layers and gated shared experts), one row or several at different positions; and models it does not take say why."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

import moed.kernels.native_cpu as native_cpu
from helpers.gguf_writer import write_tiny_gguf
from helpers.native_switch import without_native_kernels
from helpers.tiny_models import build_tiny_model
from moed.engine.runtime import open_runtime
from moed.models.decode_chain import DecodeChain, Unsupported
from moed.runner.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(native_cpu.native() is None, reason="native CPU kernels not built")

PROMPTS = [[5, 17, 33, 2, 9, 101, 44], [7, 8], [300, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
STEPS = 9


def _hf_bf16(family, root):
    model = build_tiny_model(family, root / "fp32")
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    return root / "bf16"


def _gguf(family, root, experts, weights):
    path, _, _ = write_tiny_gguf(family, root, expert_type=experts, weight_type=weights)
    return path


CASES = {
    "qwen3_moe-hf-bf16": lambda root: _hf_bf16("qwen3_moe", root),  # per-head q/k norm, bf16 router
    "mixtral-hf-bf16": lambda root: _hf_bf16("mixtral", root),
    "qwen2_moe-hf-bf16": lambda root: _hf_bf16("qwen2_moe", root),  # a dense layer, a gated shared expert
    "gpt_oss-hf-bf16": lambda root: _hf_bf16("gpt_oss", root),  # biases, sinks, sliding windows, top-k softmax
    "qwen3_moe-gguf-q8": lambda root: _gguf("qwen3_moe", root, T.Q8_0, T.Q8_0),  # q8 packed projections
    "qwen3_moe-gguf-q4_1": lambda root: _gguf("qwen3_moe", root, T.Q4_1, T.Q4_1),  # int4 bank, Q4_1 rows, f32 router
    # a Q4_K_M-style mix of projections: Q4_K q/k/o and a Q6_K v (one ggml call), a Q8_0 (q8) lm_head
    "qwen3_moe-gguf-kquants": lambda root: write_tiny_gguf(
        "qwen3_moe", root, expert_type=T.Q4_K, weight_type=T.Q4_K, hidden_size=256, head_dim=64,
        moe_intermediate_size=256, tensor_types={"blk.0.attn_v.weight": T.Q6_K, "blk.1.attn_v.weight": T.Q6_K,
                                                 "output.weight": T.Q8_0, "blk.1.attn_q.weight": T.Q5_0})[0],
    "gpt_oss-gguf-bf16": lambda root: _gguf("gpt_oss", root, T.Q8_0, T.BF16),
    # the ggml bank (GGUF block rows in their own types: Q4_K, a Q6_K down) through the chain's ggml layers
    "qwen3_moe-gguf-ggml": lambda root: (write_tiny_gguf("qwen3_moe", root, expert_type=T.Q4_K, weight_type=T.Q8_0,
                                                         tensor_types={"blk.1.ffn_down_exps.weight": T.Q6_K},
                                                         hidden_size=256, moe_intermediate_size=256)[0],
                                         {"experts_dtype": "ggml"}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def runtime(request, tmp_path_factory):
    source = CASES[request.param](tmp_path_factory.mktemp(request.param))
    path, options = source if isinstance(source, tuple) else (source, {})
    rt = open_runtime(path, **options)
    yield rt
    rt.close()


def _decode(model, chain_on: bool, prompts, slots):
    """Prefill ``prompts`` into ``slots`` (Python path), then STEPS greedy decode steps of all rows
    together; returns (logits per step, the cache, experts run)."""
    chain = model.decode_chain()
    assert isinstance(chain, DecodeChain), chain
    model._chain = chain if chain_on else Unsupported("test: the Python path")
    try:
        cache = model.new_cache(4, 64)
        last = []
        for p, slot in zip(prompts, slots):
            logits = model.forward(ForwardBatch.from_token_lists([p], [0], [slot]), cache)
            last.append(int(logits[0].argmax()))
        starts = [len(p) for p in prompts]
        before = model.executor.num_experts_run
        steps = []
        for _ in range(STEPS):
            logits = model.forward(ForwardBatch.from_token_lists([[t] for t in last], starts, slots), cache)
            steps.append(logits)
            last = logits.argmax(-1).tolist()
            starts = [s + 1 for s in starts]
        return steps, cache, model.executor.num_experts_run - before
    finally:
        model._chain = chain


@pytest.mark.parametrize("rows", [1, 3])
def test_the_chain_gives_the_python_paths_bits(runtime, rows):
    model = runtime.model
    prompts, slots = PROMPTS[:rows], [2, 0, 3][:rows]
    ours, our_cache, our_experts = _decode(model, True, prompts, slots)
    ref, ref_cache, ref_experts = _decode(model, False, prompts, slots)
    assert model.decode_chain().last_ids is not None
    assert model.decode_chain().head is not None, "the final norm and lm_head should run in the chain too"
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max().item()}"
    for layer, (x, y) in enumerate(zip(our_cache.layers, ref_cache.layers)):
        for name in x:
            assert torch.equal(x[name], y[name]), f"layer {layer} {name} cache differs"
    assert our_experts == ref_experts > 0
    assert not torch.equal(ours[0], ours[-1]), "degenerate: the steps did not move"


def test_the_chain_reports_where_time_goes(runtime):
    model = runtime.model
    chain = model.decode_chain()
    timings = chain.enable_timings()
    try:
        _decode(model, True, PROMPTS[:1], [0])
        assert bool((timings > 0).all()), timings
    finally:
        chain.timings = None


def test_the_chain_follows_the_switch_to_the_numba_kernels(runtime):
    """A chain built while the native kernels were on stands aside when they are switched off."""
    model = runtime.model
    assert isinstance(model.decode_chain(), DecodeChain)
    ref, _, _ = _decode(model, True, PROMPTS[:1], [0])
    with without_native_kernels():
        cache = model.new_cache(1, 64)
        model.forward(ForwardBatch.from_token_lists([PROMPTS[0]], [0], [0]), cache)
        chain = model.decode_chain()
        x = torch.zeros(1, 1, model.config.hidden_size)
        assert not chain.applies(x, cache)


def test_bad_slots_are_refused_before_the_native_call(runtime):
    model = runtime.model
    chain = model.decode_chain()
    cache = model.new_cache(1, 16)
    batch = ForwardBatch.from_token_lists([[5]], [3], [4])  # slot 4 of a 1-slot cache
    x = torch.zeros(1, 1, model.config.hidden_size)
    cos_sin = model.rotary.cos_sin(batch.positions)
    with pytest.raises(ValueError, match="slot 4 does not exist"):
        chain.run(x, batch, cache, cos_sin)
    full = ForwardBatch.from_token_lists([[5]], [16], [0])  # past the cache's 16 tokens
    with pytest.raises(ValueError, match="needs 2 blocks for 17 tokens"):
        chain.run(x, full, cache, model.rotary.cos_sin(full.positions))


@pytest.mark.parametrize("family,why", [("deepseek_v3", "mla attention"), ("olmoe", "whole projection")])
def test_models_it_does_not_take_say_why(family, why, tmp_path):
    rt = open_runtime(_hf_bf16(family, tmp_path))
    try:
        chain = rt.model.decode_chain()
        assert isinstance(chain, Unsupported) and why in chain.reason, chain
    finally:
        rt.close()


def test_a_float32_shared_expert_gate_keeps_the_python_path(tmp_path):
    """A GGUF keeps Qwen2-MoE's [1, D] shared-expert gate in F32 (torch multiplies it, not the chain)."""
    rt = open_runtime(_gguf("qwen2_moe", tmp_path, T.Q8_0, T.Q8_0))
    try:
        chain = rt.model.decode_chain()
        assert isinstance(chain, Unsupported) and "shared expert gate" in chain.reason, chain
    finally:
        rt.close()


def test_float32_projections_keep_the_python_path(tmp_path):
    build_tiny_model("mixtral", tmp_path / "m")
    rt = open_runtime(tmp_path / "m")
    try:
        chain = rt.model.decode_chain()
        assert isinstance(chain, Unsupported) and "projections" in chain.reason, chain
    finally:
        rt.close()


def test_the_environment_switch_turns_it_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MOED_DECODE_CHAIN", "0")
    rt = open_runtime(_hf_bf16("qwen3_moe", tmp_path))
    try:
        chain = rt.model.decode_chain()
        assert isinstance(chain, Unsupported) and "MOED_DECODE_CHAIN" in chain.reason
    finally:
        rt.close()


def test_the_decode_swiglu_and_sigmoid_gate_match_torch():
    lib = native_cpu.native()
    gen = torch.Generator().manual_seed(4)
    g, u = torch.randn(3, 1, 70, generator=gen) * 4, torch.randn(3, 1, 70, generator=gen)
    torch.testing.assert_close(lib.swiglu(g, u), torch.nn.functional.silu(g) * u, rtol=1e-6, atol=1e-6)
    z, y = torch.randn(3, 1, generator=gen) * 3, torch.randn(3, 70, generator=gen)
    torch.testing.assert_close(lib.sigmoid_scale(z, y), torch.sigmoid(z) * y, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="swiglu"):
        lib.swiglu(g, u[..., :69])
    with pytest.raises(ValueError, match="sigmoid_scale"):
        lib.sigmoid_scale(torch.zeros(3, 2), y)


def test_the_chain_gives_the_python_paths_bits_on_a_q8_0_kv_pool(runtime):
    """--kv-type q8_0: the chain's attention writes and reads the int8 blocks and their scales as the per-layer
    native kernel does."""
    model = runtime.model
    if any(shape[-1] % 32 for shape in model.cache_entries()[0].values()):
        pytest.skip("q8_0 K/V needs head dims of a multiple of 32")
    kv_dtype, model.kv_dtype = model.kv_dtype, torch.int8
    try:
        ours, our_cache, _ = _decode(model, True, PROMPTS, [2, 0, 3])
        ref, ref_cache, _ = _decode(model, False, PROMPTS, [2, 0, 3])
    finally:
        model.kv_dtype = kv_dtype
    assert our_cache.quantized
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max().item()}"
    for x, y in zip(our_cache.layers, ref_cache.layers):
        for name in x:
            assert torch.equal(x[name], y[name]), f"{name} differs"


def test_the_chain_follows_a_pool_resized_in_place(runtime):
    """KVCache.resized keeps the object and replaces its tensors: the chain must bind the new ones (it kept
    the freed pool's addresses before)."""
    model = runtime.model
    cache = model.new_pool(64, 16)
    table = list(range(40, 48))
    prompt = PROMPTS[0]
    model.forward(ForwardBatch.from_token_lists([prompt], [0], [0], [table]), cache)
    step = lambda c, t: model.forward(ForwardBatch.from_token_lists([[5]], [len(prompt)], [0], [t]), c)  # noqa: E731
    step(cache, table)  # the chain binds this pool
    model.resize_pool(cache, 32, [(b, b - 40) for b in table])  # the shrink moves the blocks down
    moved = [b - 40 for b in table]
    got = step(cache, moved)
    model._chain, chain = Unsupported("test: the Python path"), model.decode_chain()
    try:
        want = step(cache, moved)
    finally:
        model._chain = chain
    assert torch.equal(got, want)
