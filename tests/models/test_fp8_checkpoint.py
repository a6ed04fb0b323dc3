"""Block-scaled FP8 checkpoints (DeepSeek-V3 / Qwen3-FP8 layout) load and match transformers on the
dequantised weights (issue #10). Blocks of 32x32 here so tiny dimensions span several blocks, some
partial."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.fp8_packer import dequantize_reference, quantize_fp8_blocks, write_fp8_checkpoint
from helpers.reference_parity import assert_matches_reference
from helpers.tiny_models import build_tiny_model
from moed.engine.runtime import open_runtime
from moed.errors import ModelFormatError, UnsupportedModelError
from moed.weights.fp8_blocks import dequantize_fp8_blocks

BLOCK = (32, 32)


def test_dequantiser_matches_an_independent_float64_reference():
    w = torch.randn(70, 45, generator=torch.Generator().manual_seed(0)) * 3
    q, s = quantize_fp8_blocks(w, BLOCK)
    assert s.shape == (3, 2)
    ours = dequantize_fp8_blocks(q, s, BLOCK, "test")
    ref = dequantize_reference(q, s, BLOCK)
    assert torch.allclose(ours.double(), ref, rtol=1e-6, atol=0)
    assert (ref - w.double()).abs().max() < 0.07 * w.abs().max()  # the packer is a sane FP8 quantiser


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def fp8_model(request, tmp_path_factory):
    family = request.param
    src = tmp_path_factory.mktemp(f"{family}-f32")
    reference = build_tiny_model(family, src)
    dst = tmp_path_factory.mktemp(f"{family}-fp8")
    weights = write_fp8_checkpoint(src, dst, BLOCK)
    # the reference: transformers in float32 on the dequantised weights, saved in the on-disk layout
    # (transformers itself maps it onto its in-memory one)
    ref_dir = tmp_path_factory.mktemp(f"{family}-dequantised")
    save_file(weights, ref_dir / "model.safetensors")
    (ref_dir / "config.json").write_text((src / "config.json").read_text())
    import transformers as tf

    reference = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager")
    return family, dst, reference.eval()


def test_fp8_checkpoint_matches_transformers_on_the_dequantised_weights(fp8_model):
    family, path, reference = fp8_model
    runtime = open_runtime(path, weights_dtype="fp32", experts_dtype="fp32")
    try:
        assert_matches_reference(runtime, reference, tol=1e-3, what=family)
    finally:
        runtime.close()
    native = open_runtime(path)  # by default FP8 weights become bf16, the experts a bf16 bank
    try:
        mats = [t for n, t in native.loaded.weights.items() if t.dim() == 2 and "self_attn" in n]
        assert mats and all(t.dtype == torch.bfloat16 for t in mats)
        assert native.loaded.bank.dtype == "bf16"
    finally:
        native.close()


def test_fp8_without_scales_or_an_unknown_method_is_one_clear_error(fp8_model, tmp_path):
    _, path, _ = fp8_model
    broken = tmp_path / "no-scales"
    broken.mkdir()
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("_scale_inv")}, broken / "model.safetensors")
    (broken / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelFormatError, match="weight_scale_inv.*missing") as info:
        open_runtime(broken)
    assert "model.safetensors" in str(info.value) and "\n" not in str(info.value)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gptq.*not supported"):
        open_runtime(broken)


def test_fp8_checkpoint_converts_to_ftw_with_the_same_weights(fp8_model, tmp_path):
    from moed.weights.converter import convert_model

    _, path, _ = fp8_model
    dst = convert_model(path, tmp_path / "ftw")  # both sides take the default (bf16) bank
    hf, ftw = open_runtime(path), open_runtime(dst)
    try:
        assert sorted(hf.loaded.weights) == sorted(ftw.loaded.weights)
        for name, t in hf.loaded.weights.items():
            assert torch.equal(ftw.loaded.weights[name], t), name
        for name, t in hf.loaded.bank.tensors.items():
            assert torch.equal(ftw.loaded.bank.tensors[name], t), name
    finally:
        hf.close()
        ftw.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_an_mla_models_fp8_linears_stay_fp8_on_a_cpu_only_load(tmp_path, family):
    """DeepSeek-V3's layout with 128 x 128 blocks: a CPU-only load keeps the FP8 linears as stored (e4m3 codes
    and their block scales, ``PackedLinear("fp8")``, half the bytes of bf16) and its logits are transformers'
    on the dequantised weights; kv_b (the absorbed decode splits it per head) and a device load widen to bf16."""
    from helpers.tiny_models import tiny_config
    from moed.config import EngineConfig
    from moed.layers.packed_linear import PackedLinear
    from moed.weights.model_loader import estimate_load

    config = tiny_config(family)
    config.hidden_size = config.q_lora_rank = config.kv_lora_rank = 128
    config.intermediate_size = config.moe_intermediate_size = 128
    config.qk_nope_head_dim, config.v_head_dim = 32, 32  # o_proj's K: 4 heads x 32
    dst, reference = _fp8_checkpoint_and_reference(tmp_path, family, config)
    stored = load_file(dst / "model.safetensors")

    runtime = open_runtime(dst, experts_dtype="fp32")  # the CPU (open_runtime's default device)
    try:
        w = runtime.loaded.weights
        q_a = w["model.layers.1.self_attn.q_a_proj.weight"]
        assert isinstance(q_a, PackedLinear) and q_a.dtype == "fp8"
        assert torch.equal(q_a.arrays[0], stored["model.layers.1.self_attn.q_a_proj.weight"].view(torch.uint8))
        kept = [n for n, t in w.items() if isinstance(t, PackedLinear)]
        assert {n.split(".", 3)[3] for n in kept} >= {"self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight",
                                                     "self_attn.kv_a_proj_with_mqa.weight", "self_attn.o_proj.weight"}
        assert isinstance(w["model.layers.1.self_attn.kv_b_proj.weight"], torch.Tensor)
        if family == "deepseek_v32":  # the lightning indexer's projections too (its head weights stay a tensor)
            assert isinstance(w["model.layers.1.self_attn.indexer.wq_b.weight"], PackedLinear)
            assert isinstance(w["model.layers.1.self_attn.indexer.weights_proj.weight"], torch.Tensor)
        assert_matches_reference(runtime, reference, tol=2e-2, tokens_equal=True, what="fp8 kept")
    finally:
        runtime.close()
    kept_bytes = estimate_load(dst, cpu_only=True).weight_bytes
    widened_bytes = estimate_load(dst, cpu_only=False).weight_bytes
    assert kept_bytes < widened_bytes
    device = open_runtime(dst, engine=EngineConfig(device="emulated"))
    try:
        assert not any(isinstance(t, PackedLinear) for t in device.loaded.weights.values())
    finally:
        device.close()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_moe"])
def test_gqa_and_hybrid_models_fp8_attention_stays_fp8_on_a_cpu_only_load(tmp_path, family):
    """Qwen3-Next's layout (its CPU decode runs layer by layer) and Qwen3-MoE's (Qwen3-30B-A3B-FP8: the native
    decode chain multiplies the FP8 rows): the attention layers' FP8 projections stay as stored and the model
    matches transformers on the dequantised weights."""
    from helpers.tiny_models import tiny_config
    from moed.layers.packed_linear import PackedLinear
    from moed.models.decode_chain import DecodeChain

    config = tiny_config(family)
    config.hidden_size, config.moe_intermediate_size = 128, 128
    if family == "qwen3_next":
        config.shared_expert_intermediate_size = 128
    else:  # o_proj's K: 4 heads x 32
        config.num_attention_heads, config.head_dim = 4, 32
    dst, reference = _fp8_checkpoint_and_reference(tmp_path, family, config)
    runtime = open_runtime(dst, experts_dtype="fp32")
    try:
        w = runtime.loaded.weights
        assert all(isinstance(w[f"model.layers.1.self_attn.{p}_proj.weight"], PackedLinear) for p in "qkvo")
        if family == "qwen3_moe":
            assert isinstance(runtime.model.decode_chain(), DecodeChain), runtime.model.decode_chain()
            assert_matches_reference(runtime, reference, tol=2e-2, tokens_equal=True, what="qwen3_moe fp8 kept")
        else:  # the DeltaNet's FP8 projections are widened to bf16 (one rounding each): within 5% of the range
            assert_matches_reference(runtime, reference, tol=5e-2, tokens_equal=False, what="qwen3_next fp8 kept")
    finally:
        runtime.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_experts_stay_fp8_on_a_cpu_only_load(tmp_path, family):
    """128 x 128 blocks (Qwen3-30B-A3B-FP8, DeepSeek-V3): a CPU-only load keeps the routed experts as stored, in the
    ggml bank's FP8_B128 rows (e4m3 codes and their block's float32 scale, 8.25 bits a weight where bf16 takes 16):
    every row decodes to the independent reference's values, the estimate counts those bytes, the model matches
    transformers on the dequantised weights within the int8 activations' error, and a device load still builds
    the bf16 bank."""
    from helpers.tiny_models import tiny_config
    from moed.config import EngineConfig
    from moed.kernels.fp8_block_format import FP8_B128
    from moed.kernels.ggml_rows_format import dequantize_rows
    from moed.weights.hf_checkpoint import HfCheckpoint
    from moed.weights.model_loader import estimate_load, load_model

    config = tiny_config(family)
    config.hidden_size, config.moe_intermediate_size, config.intermediate_size = 128, 128, 128
    if family == "qwen3_moe":
        config.num_attention_heads, config.head_dim = 4, 32
    else:
        config.q_lora_rank = config.kv_lora_rank = 128
        config.qk_nope_head_dim, config.v_head_dim = 32, 32
    dst, reference = _fp8_checkpoint_and_reference(tmp_path, family, config)

    checkpoint = HfCheckpoint(dst)
    assert checkpoint.default_bank_dtype() == "bf16" and checkpoint.prefers_ggml()
    bank = load_model(dst, cpu_only=True).bank
    assert bank.dtype == "ggml" and set(bank.row_types.values()) == {FP8_B128}
    assert estimate_load(dst, cpu_only=True).bank_bytes == bank.nbytes()
    assert bank.nbytes() * 1.9 < estimate_load(dst).bank_bytes  # against the bf16 bank
    stored = load_file(dst / "model.safetensors")
    layer = checkpoint.config.moe_layers.index(True)
    for kind in ("gate", "up", "down"):
        rows, _ = bank.ggml_matrix(kind, 0)
        for e in range(bank.num_experts):
            key = f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight"
            want = dequantize_reference(stored[key], stored[key + "_scale_inv"], (128, 128)).float()
            assert torch.equal(dequantize_rows(rows[e], FP8_B128, want.shape[1]), want), (kind, e)
    runtime = open_runtime(dst)  # the CPU: FP8 experts and linears as stored, native kernels
    try:
        assert runtime.loaded.bank.dtype == "ggml"
        # int8 activations against transformers' float32 (the bf16 bank's float activations come to ~0.02 of
        # the range, a q8 bank's ~0.05): logits within 5% over four prompts; greedy tokens may part at a near-tie
        for seed in range(4):
            assert_matches_reference(runtime, reference, tol=5e-2, tokens_equal=False, seed=seed,
                                     what=f"{family} fp8 experts kept")
    finally:
        runtime.close()
    device = open_runtime(dst, engine=EngineConfig(device="emulated"))
    try:
        assert device.loaded.bank.dtype == "bf16"
    finally:
        device.close()


def _fp8_checkpoint_and_reference(tmp_path, family, config):
    """``config`` built as a tiny float model, written as a 128 x 128 block-scaled FP8 checkpoint; returns its path
    and transformers in float32 on its dequantised weights."""
    import transformers as tf

    src = tmp_path / "f32"
    build_tiny_model(family, src, config=config)
    dst = tmp_path / "fp8"
    weights = write_fp8_checkpoint(src, dst, (128, 128))
    ref_dir = tmp_path / "dequantised"
    ref_dir.mkdir()
    save_file(weights, ref_dir / "model.safetensors")
    (ref_dir / "config.json").write_text((src / "config.json").read_text())
    reference = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager")
    return dst, reference.eval()
