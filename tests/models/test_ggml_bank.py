"""The ggml expert bank: a GGUF file's expert tensors kept block for block in their own types (issue #31).

A Q4_K_M file (Q4_K gate/up, Q6_K down in some layers) loads with ``--experts-dtype ggml`` without
re-quantising anything: every slot's type reads back as the header says, the bank's bytes are the
file's, and the model runs like transformers on the gguf-decoded weights: exactly (float arithmetic
only) through the torch path, within the int8-activation tolerance through the native kernels,
closer than the int4 and q8 banks that re-quantise the mix.
"""

from __future__ import annotations

import contextlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import load_dequantised_into, write_tiny_gguf
from helpers.native_switch import without_native_kernels
from helpers.reference_parity import assert_matches_reference
from moed.engine.runtime import open_runtime
from moed.errors import InvalidRequestError
from moed.experts.expert_ffn import run_expert
from moed.experts.routed_ffn import run_routed
from moed.kernels.native_cpu import native
from moed.weights.model_loader import load_model

DIMS = dict(hidden_size=256, moe_intermediate_size=256)  # whole 256-weight K-quant blocks
Q4_K_M = {"blk.0.ffn_down_exps.weight": T.Q6_K, "blk.2.ffn_down_exps.weight": T.Q6_K}


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4km")
    path, _, model = write_tiny_gguf("qwen3_moe", root, expert_type=T.Q4_K, weight_type=T.Q8_0, tensor_types=Q4_K_M,
                                     **DIMS)
    load_dequantised_into(model, "qwen3_moe", path)
    return path, model.eval()


def test_every_slot_keeps_the_type_and_bytes_the_header_gives(q4_k_m):
    path, _ = q4_k_m
    bank = load_model(path, experts_dtype="ggml").bank
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    for layer in range(3):
        for kind in ("gate", "up", "down"):
            tensor = by_name[f"blk.{layer}.ffn_{kind}_exps.weight"]
            stored, ggml_type = bank.ggml_matrix(kind, layer)
            assert ggml_type == int(tensor.tensor_type), (layer, kind)
            assert torch.equal(stored.reshape(-1), torch.from_numpy(np.asarray(tensor.data).reshape(-1).view(np.uint8)))
    assert {bank.row_types[f"down.{i}"] for i in range(3)} == {int(T.Q4_K), int(T.Q6_K)}
    assert bank.nbytes() == sum(by_name[f"blk.{i}.ffn_{k}_exps.weight"].n_bytes for i in range(3)
                                for k in ("gate", "up", "down"))


def test_the_torch_path_is_the_reference_model(q4_k_m):
    path, model = q4_k_m
    runtime = open_runtime(path, experts_dtype="ggml", weights_dtype="fp32")
    try:
        with without_native_kernels():
            assert_matches_reference(runtime, model, tol=1e-3, tokens_equal=True, steps=8, seed=3)
    finally:
        runtime.close()


def test_kept_weights_come_closer_than_the_re_quantised_banks(q4_k_m):
    """Random K-quant blocks make these tiny models chaotic (large weights: the int8 activations alone
    move logits by 10-70% of their range, and a prompt whose routing flips jumps by several units).
    Median of the largest logit error over 8 prompts: through the native kernels (int8 activations)
    ggml and q8 stay far below int4, which re-quantises the Q6_K rows to 4 bits; with
    float activations (no native kernels: the weights alone, the same on every CPU) ggml, holding the
    file's exact weights, is below q8."""
    if native() is None:
        pytest.skip("the native CPU kernels are not built")
    path, model = q4_k_m

    def mean_err(dtype: str, float_activations: bool) -> float:
        runtime = open_runtime(path, experts_dtype=dtype)
        try:
            with without_native_kernels() if float_activations else contextlib.nullcontext():
                errs = [assert_matches_reference(runtime, model, tol=10.0, tokens_equal=False, steps=1, seed=s)
                        for s in range(8)]
                return float(torch.tensor(errs).median())
        finally:
            runtime.close()

    native_errs = {dtype: mean_err(dtype, False) for dtype in ("ggml", "q8", "int4")}
    assert native_errs["ggml"] < native_errs["int4"] / 3 and native_errs["q8"] < native_errs["int4"] / 3, native_errs
    assert mean_err("ggml", True) < mean_err("q8", True)


def test_a_layer_in_one_native_call_equals_its_experts_one_by_one(q4_k_m):
    if native() is None:
        pytest.skip("the native CPU kernels are not built")
    path, _ = q4_k_m
    bank = load_model(path, experts_dtype="ggml").bank
    torch.manual_seed(0)
    x = torch.randn(5, bank.hidden_size)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(5)]) + 2 * 8  # layer 2
    ids[1, 1] = -1  # a slot run elsewhere
    weights = torch.rand(5, 2)
    per_slot, y = run_routed(bank, x, ids, weights)
    want = torch.zeros_like(y)
    for n in range(5):
        for a in range(2):
            if ids[n, a] < 0:
                continue
            one = run_expert(bank, int(ids[n, a]), x[n:n + 1])[0]
            assert torch.equal(per_slot[n, a], one)  # an expert's rows do not depend on the call's other work
            want[n] += weights[n, a] * one
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_one_call_runs_one_layer(q4_k_m):
    if native() is None:
        pytest.skip("the native CPU kernels are not built")
    path, _ = q4_k_m
    bank = load_model(path, experts_dtype="ggml").bank
    x = torch.randn(1, bank.hidden_size)
    with pytest.raises(ValueError, match="span layers 1 to 2"):
        run_routed(bank, x, torch.tensor([[8 + 3, 2 * 8 + 1]], dtype=torch.int32), torch.ones(1, 2))
    nothing, y = run_routed(bank, x, torch.full((1, 2), -1, dtype=torch.int32), torch.ones(1, 2))
    assert torch.equal(y, torch.zeros(1, bank.hidden_size))


def test_only_gguf_sources_and_kept_types_load_as_ggml(tmp_path):
    path, hf, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.F32)
    with pytest.raises(InvalidRequestError, match="is F32; the ggml bank keeps .*Q4_K.*: load it with another"):
        load_model(path, experts_dtype="ggml")
    with pytest.raises(InvalidRequestError, match="keeps a GGUF file.s own block types, or an NVFP4, FP8 or MXFP8 checkpoint.s blocks; .* is a Hugging Face"):
        load_model(hf, experts_dtype="ggml")


def test_a_prefill_chunk_multiplies_decoded_rows(q4_k_m):
    """Many tokens of one expert go through bf16 GEMMs on its rows decoded once (where the CPU's bf16
    GEMMs are native): within bf16 rounding of the float reference."""
    from moed.experts.expert_ffn import ggml_expert_gemm

    if native() is None:
        pytest.skip("the native CPU kernels are not built")
    path, _ = q4_k_m
    bank = load_model(path, experts_dtype="ggml").bank
    x = torch.randn(40, bank.hidden_size)
    got = ggml_expert_gemm(bank, 8 + 3, x)
    with without_native_kernels():
        want = run_expert(bank, 8 + 3, x)
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max())


def test_on_the_cpu_a_file_the_default_bank_would_re_quantise_loads_as_stored(q4_k_m, tmp_path):
    """The CPU default keeps a Q4_K_M file's types (its Q6_K down would be re-quantised into int4);
    for a device the default stays int4 (its CUDA kernel; the ggml slots decode with torch ops, asked for
    with --experts-dtype ggml); a Q8_0 or plain Q4_K file keeps its lossless bank either way."""
    path, _ = q4_k_m
    assert load_model(path, cpu_only=True).bank.dtype == "ggml"
    assert load_model(path).bank.dtype == "int4"
    q8_path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path / "q8", expert_type=T.Q8_0, weight_type=T.Q8_0)
    assert load_model(q8_path, cpu_only=True).bank.dtype == "q8"
    q4k_path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path / "q4k", expert_type=T.Q4_K, weight_type=T.Q8_0, **DIMS)
    assert load_model(q4k_path, cpu_only=True).bank.dtype == "int4"


def test_on_a_device_the_kept_types_run_from_the_cache_slots(q4_k_m):
    """``--experts-dtype ggml`` with a device: the experts stay as stored in the host bank and in the
    device's cache slots (each layer's rows decoded there, experts/ggml_slots.py), and the model is the
    reference's, as on the CPU: the same float arithmetic with the native kernels off."""
    from moed.config import EngineConfig
    from moed.experts.hybrid_executor import HybridExecutor

    path, model = q4_k_m
    runtime = open_runtime(path, experts_dtype="ggml", weights_dtype="fp32",
                           engine=EngineConfig(device="emulated", cache_fraction=0.5))
    try:
        assert isinstance(runtime.executor, HybridExecutor) and runtime.loaded.bank.dtype == "ggml"
        with without_native_kernels():
            assert_matches_reference(runtime, model, tol=1e-3, tokens_equal=True, steps=8, seed=3)
        stats = runtime.executor.stats
        assert stats.hits > 0 and stats.fills > 0 and stats.cache_slots > 0
    finally:
        runtime.close()


def test_the_load_estimate_counts_the_bank_the_load_builds(q4_k_m):
    """The memory check before a load sizes the bank the load will build: on a CPU-only machine a
    Q4_K_M file's experts as stored, not the int4 bank a device load would make."""
    from moed.engine.load_plan import plan_load
    from moed.engine.model_manager import LoadOptions
    from moed.weights.model_loader import estimate_load

    path, _ = q4_k_m
    est = estimate_load(path, cpu_only=True)
    assert est.bank_dtype == "ggml" and est.bank_bytes == load_model(path, cpu_only=True).bank.nbytes()
    assert estimate_load(path).bank_dtype == "int4"
    plan = plan_load(path, LoadOptions(context_length=256, device="cpu"))
    assert plan.bank_dtype == "ggml" and plan.bank_bytes == est.bank_bytes


def test_converting_such_a_file_to_ftw_says_how_to_keep_its_types(q4_k_m, tmp_path, caplog):
    from moed.weights.converter import convert_model

    path, _ = q4_k_m
    with caplog.at_level("WARNING", logger="moed.weights"):
        convert_model(path, tmp_path / "out.ftw")
    said = [r.getMessage() for r in caplog.records]
    assert any("stored as Q6_K" in m for m in said), said  # the re-quantised down layers, named
    assert any("to keep this checkpoint's types, run it itself" in m for m in said), said


def test_an_nvfp4_file_keeps_its_blocks_and_runs_as_the_reference(tmp_path):
    """llama.cpp's NVFP4 (E2M1 codes, an unsigned E4M3 scale per 16) loads block for block on the CPU
    and the model is transformers' on the gguf-decoded weights; for a device it is re-quantised to int4
    and the load says so (issue #33)."""
    path, _, model = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.NVFP4, weight_type=T.Q8_0, **DIMS)
    load_dequantised_into(model, "qwen3_moe", path)
    bank = load_model(path, cpu_only=True).bank
    assert bank.dtype == "ggml" and set(bank.row_types.values()) == {int(T.NVFP4)}
    assert bank.nbytes() == sum(t.n_bytes for t in gguf.GGUFReader(str(path)).tensors if "_exps." in t.name)
    runtime = open_runtime(path, experts_dtype="ggml", weights_dtype="fp32")
    try:
        with without_native_kernels():
            assert_matches_reference(runtime, model, tol=1e-3, tokens_equal=True, steps=8, seed=3)
    finally:
        runtime.close()
    assert load_model(path).bank.dtype == "int4"


def test_a_q4_k_m_files_projections_keep_their_types_too(tmp_path):
    """llama.cpp's Q4_K_M layout beyond the experts: Q4_K attention, a Q6_K attn_v in some layers and a Q6_K
    output. A default load keeps every one as the header says, byte for byte (PackedLinear GGUF rows), and
    reports nothing changed."""
    from moed.layers.packed_linear import PackedLinear
    from moed.weights.gguf_checkpoint import GgufCheckpoint

    types = {**Q4_K_M, "blk.0.attn_v.weight": T.Q6_K, "blk.2.attn_v.weight": T.Q6_K, "output.weight": T.Q6_K}
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q4_K, weight_type=T.Q4_K, tensor_types=types,
                                 head_dim=64, **DIMS)
    gg = GgufCheckpoint(path)
    by_name = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    runtime = open_runtime(path)
    try:
        loaded = runtime.loaded
        assert loaded.bank.dtype == "ggml"
        packed = {name: w for name, w in loaded.weights.items() if isinstance(w, PackedLinear)}
        assert len(packed) == 4 * 3 + 2  # q, k, v, o per layer, the lm_head and the embedding
        for name, w in packed.items():
            tensor = by_name[gg.weight_keys[name]]
            assert w.ggml_type == int(tensor.tensor_type), name
            assert torch.equal(w.arrays[0].reshape(-1), torch.from_numpy(np.array(tensor.data).reshape(-1).view(np.uint8)))
        assert {packed[f"model.layers.{i}.self_attn.v_proj.weight"].dtype for i in range(3)} == {"q4_k", "q6_k"}
        assert packed["lm_head.weight"].dtype == "q6_k"
        assert packed["model.embed_tokens.weight"].dtype == "q4_k"
        assert gg.type_changes("ggml") == []
    finally:
        runtime.close()
