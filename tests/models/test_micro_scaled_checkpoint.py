"""NVFP4 and MXFP8 checkpoints as llm-compressor (compressed-tensors) and NVIDIA ModelOpt publish them
(issue #33): written here by compressed-tensors itself, read by moed, and checked against that
library's own dequantiser and transformers on the weights it dequantises.

On the CPU an NVFP4 checkpoint's experts stay as stored (llama.cpp NVFP4 rows in the ggml bank, the
per-tensor global scale beside each expert matrix); MXFP8 experts become a bf16 bank, exactly. What
a load changes (NVFP4 experts re-quantised for a device, NVFP4 attention decoded to bf16) is said.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.micro_scaled_writer import dequantised_reference, write_compressed_tensors, write_modelopt_nvfp4
from helpers.native_switch import without_native_kernels
from helpers.reference_parity import assert_matches_reference
from helpers.tiny_models import build_tiny_model
from moed.engine.runtime import open_runtime
from moed.experts.routed_ffn import run_routed
from moed.errors import ModelFormatError, UnsupportedModelError
from moed.kernels.gguf_quants import NVFP4, dequantize
from moed.kernels.native_cpu import native
from moed.kernels.nvfp4_format import dequantize_mxfp8, dequantize_nvfp4, to_ggml_nvfp4
from moed.weights.hf_checkpoint import HfCheckpoint
from moed.weights.model_loader import estimate_load, load_model

pytest.importorskip("compressed_tensors")

LAYOUTS = ("nvfp4", "modelopt", "mxfp8")


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoints(request, tmp_path_factory):
    """Per family: the three layouts and, for each, transformers on compressed-tensors' dequantised weights."""
    import transformers as tf

    family = request.param
    root = tmp_path_factory.mktemp(family)
    build_tiny_model(family, root / "src")
    paths = {"nvfp4": write_compressed_tensors(root / "src", root / "nvfp4", "NVFP4A16"),
             "mxfp8": write_compressed_tensors(root / "src", root / "mxfp8", "MXFP8A16")}
    paths["modelopt"] = write_modelopt_nvfp4(paths["nvfp4"], root / "modelopt")
    refs = {}
    for name in ("nvfp4", "mxfp8"):
        ref_dir = dequantised_reference(paths[name], root / f"{name}-ref", like=root / "src")
        refs[name] = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    refs["modelopt"] = refs["nvfp4"]
    return family, paths, refs


def _quantised_modules(state: dict[str, torch.Tensor], first: str) -> list[str]:
    return sorted(k[:-len(first) - 1] for k, v in state.items()
                  if k.endswith("." + first) and v.dtype in (torch.uint8, torch.float8_e4m3fn))


def test_the_references_are_compressed_tensors_own_values(checkpoints, tmp_path):
    """moed's dequantisers give compressed-tensors' float32 weights bit for bit, within each format's
    error of the unquantised weights; the llama.cpp NVFP4 rows made from a checkpoint decode (gguf's
    decoder) to the same codes times the same scales."""
    _, paths, _ = checkpoints
    plain = load_file(paths["nvfp4"].parent / "src" / "model.safetensors")
    for name, first in (("nvfp4", "weight_packed"), ("mxfp8", "weight")):
        state = load_file(paths[name] / "model.safetensors")
        ref = load_file(dequantised_reference(paths[name], tmp_path / name, like=paths[name]) / "model.safetensors")
        modules = _quantised_modules(state, first)
        assert len(modules) > 20
        for m in modules:
            if name == "nvfp4":
                packed, scale = state[f"{m}.weight_packed"], state[f"{m}.weight_scale"]
                ours = dequantize_nvfp4(packed, scale, divided_by=state[f"{m}.weight_global_scale"])
                n, k = packed.shape[0], 2 * packed.shape[1]
                if k % 64:  # not whole llama.cpp blocks (DeepSeek's dense MLP down, 96 wide)
                    with pytest.raises(ValueError, match="whole 64-weight blocks"):
                        to_ggml_nvfp4(packed, scale)
                    continue
                rows = to_ggml_nvfp4(packed, scale)
                assert torch.equal(dequantize(rows.reshape(-1), NVFP4, (n, k)), dequantize_nvfp4(packed, scale))
            else:
                ours = dequantize_mxfp8(state[f"{m}.weight"], state[f"{m}.weight_scale"])
                assert torch.equal(ours.bfloat16().float(), ours)  # MXFP8 values are bf16 values
            assert torch.equal(ours, ref[f"{m}.weight"].float()), m
            # within the format's error of the unquantised (bf16) weight, per scale group
            group, bound = (16, 0.25) if name == "nvfp4" else (32, 0.07)
            w = plain[f"{m}.weight"].float()
            amax = w.view(w.shape[0], -1, group).abs().amax(-1, keepdim=True)
            assert bool(((ours - w).view(w.shape[0], -1, group).abs() <= bound * amax).all()), m


def test_a_negative_or_nan_nvfp4_scale():
    """A scale with its sign bit set moves the sign onto its 16 codes (the same values); NaN is refused."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 64), dtype=torch.uint8, generator=gen)
    values = torch.rand(3, 8, generator=gen) * 4 + 0.1
    values[1, 2] = -values[1, 2]
    values[2, 0] = -0.0
    scale = values.to(torch.float8_e4m3fn)
    rows = to_ggml_nvfp4(packed, scale)
    assert torch.equal(dequantize(rows.reshape(-1), NVFP4, (3, 128)), dequantize_nvfp4(packed, scale))
    values[0, 0] = float("nan")
    scale = values.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="NaN"):
        to_ggml_nvfp4(packed, scale)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_matches_transformers_in_float32(checkpoints, layout):
    """Widened to float32 (experts and weights) each layout is transformers on compressed-tensors'
    dequantised weights, to float32 rounding (ModelOpt's s2 = 1/g differs from g in the last bit)."""
    family, paths, refs = checkpoints
    runtime = open_runtime(paths[layout], experts_dtype="fp32", weights_dtype="fp32")
    try:
        assert_matches_reference(runtime, refs[layout], tol=1e-3, what=f"{family} {layout}")
    finally:
        runtime.close()


@pytest.mark.parametrize("layout", ["nvfp4", "modelopt"])
def test_on_the_cpu_nvfp4_experts_stay_as_stored(checkpoints, layout):
    """The CPU default keeps NVFP4 experts block for block (ggml bank, a float32 factor per expert
    matrix): the torch path is the reference model; the native kernels (int8 activations) are within
    their usual tolerance and pick the same tokens."""
    family, paths, refs = checkpoints
    est = estimate_load(paths[layout], cpu_only=True)
    bank = load_model(paths[layout], cpu_only=True).bank
    assert bank.dtype == "ggml" and set(bank.row_types.values()) == {int(NVFP4)}
    assert est.bank_dtype == "ggml" and est.bank_bytes == bank.nbytes()
    scales = [t for n, t in bank.tensors.items() if n.endswith(".scale")]
    assert len(scales) == 3 * bank.num_moe_layers and all(bool((s > 0).all()) for s in scales)
    assert len({float(s[0]) for s in scales}) > 1  # the global scales differ between tensors
    runtime = open_runtime(paths[layout], experts_dtype="ggml", weights_dtype="fp32")
    try:
        with without_native_kernels():
            assert_matches_reference(runtime, refs[layout], tol=1e-3, steps=8, what=f"{family} {layout} torch")
        if native() is None:
            return
        assert_matches_reference(runtime, refs[layout], tol=10.0, tokens_equal=False, steps=1)  # runs natively
    finally:
        runtime.close()
    # one MoE layer natively (int8 activations, the factors applied in C) against the torch path
    x = torch.randn(6, bank.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 3], [1, 2], [3, -1], [2, 1], [0, 1], [3, 2]], dtype=torch.int32)
    ids = torch.where(ids >= 0, ids + bank.num_experts, ids)  # layer 1; a slot run elsewhere
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(2))
    _, got = run_routed(bank, x, ids, weights)
    with without_native_kernels():
        _, want = run_routed(bank, x, ids, weights)
    assert float((got - want).abs().max()) < 0.03 * float(want.abs().max())


def test_what_each_load_changes_is_said(checkpoints, caplog):
    """NVFP4 experts go into int4 for a device (and say so); attention in NVFP4 is decoded to bf16 (and
    says so); MXFP8 loads into bf16 without a word: nothing changes."""
    _, paths, _ = checkpoints
    nv = HfCheckpoint(paths["nvfp4"])
    assert nv.default_bank_dtype() == "int4" and nv.prefers_ggml()
    lines = nv.type_changes("int4")
    assert any("routed experts stored as NVFP4 (compressed-tensors) are converted into the int4" in s for s in lines)
    assert any("non-expert weight(s) stored as NVFP4" in s and "decoded to bf16" in s for s in lines)
    assert not any("routed experts" in s for s in nv.type_changes("ggml"))
    with caplog.at_level("WARNING", logger="moed.weights"):
        assert load_model(paths["nvfp4"]).bank.dtype == "int4"
    assert any("converted into the int4 expert bank" in r.getMessage() for r in caplog.records)
    mx = HfCheckpoint(paths["mxfp8"])
    assert mx.default_bank_dtype() == "bf16" and mx.prefers_ggml() and mx.type_changes("bf16") == []
    assert mx.type_changes("ggml") == []
    assert load_model(paths["mxfp8"], cpu_only=True).bank.dtype == "ggml"  # MXFP8 rows, 8.25 bits a weight
    loaded = load_model(paths["mxfp8"])  # a device's bank: bf16, every MXFP8 value exactly
    assert loaded.bank.dtype == "bf16"
    assert all(t.dtype in (torch.bfloat16, torch.float32) for t in loaded.weights.values())


def test_on_the_cpu_mxfp8_experts_stay_as_stored(checkpoints):
    """The CPU default keeps MXFP8 experts block for block (ggml bank, MXFP8 rows: E8M0 + 32 e4m3 codes): the
    rows hold compressed-tensors' values exactly, the torch path is the reference model, and the native kernels
    (int8 activations) stay within 5% of the logits' range, in half the bytes of bf16."""
    from moed.kernels.fp8_block_format import MXFP8
    from moed.kernels.ggml_rows_format import dequantize_rows
    from moed.kernels.nvfp4_format import dequantize_mxfp8

    family, paths, refs = checkpoints
    est = estimate_load(paths["mxfp8"], cpu_only=True)
    bank = load_model(paths["mxfp8"], cpu_only=True).bank
    assert bank.dtype == "ggml" and set(bank.row_types.values()) == {MXFP8}
    assert est.bank_dtype == "ggml" and est.bank_bytes == bank.nbytes()
    widened = load_model(paths["mxfp8"], experts_dtype="bf16").bank
    assert bank.nbytes() * 2 < widened.nbytes() * 1.1  # 8.25 bits a weight against 16
    source = load_file(paths["mxfp8"] / "model.safetensors")
    config = HfCheckpoint(paths["mxfp8"]).config
    layer = config.moe_layers.index(True)
    for kind in ("gate", "up", "down"):  # the first MoE layer's rows hold the checkpoint's values exactly
        rows, ggml_type = bank.ggml_matrix(kind, 0)
        assert ggml_type == MXFP8
        for e in range(bank.num_experts):
            key = f"model.layers.{layer}.mlp.experts.{e}.{kind}_proj.weight"
            want = dequantize_mxfp8(source[key], source[key + "_scale"])  # compressed-tensors-checked reference
            assert torch.equal(dequantize_rows(rows[e], MXFP8, want.shape[1]), want), (kind, e)
    runtime = open_runtime(paths["mxfp8"], experts_dtype="ggml", weights_dtype="fp32")
    try:
        with without_native_kernels():
            assert_matches_reference(runtime, refs["mxfp8"], tol=1e-3, steps=8, what=f"{family} mxfp8 torch")
        if native() is not None:
            assert_matches_reference(runtime, refs["mxfp8"], tol=5e-2, tokens_equal=False, steps=1)
    finally:
        runtime.close()



def _edited(src, dst, *, state=None, config=None):
    import shutil

    shutil.copytree(src, dst)
    if state is not None:
        tensors = load_file(dst / "model.safetensors")
        state(tensors)
        save_file(tensors, dst / "model.safetensors")
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_broken_or_unknown_layouts_are_clear_errors(checkpoints, tmp_path):
    _, paths, _ = checkpoints
    state = load_file(paths["nvfp4"] / "model.safetensors")
    victim = next(k for k in state if k.endswith("experts.0.down_proj.weight_global_scale"))
    gone = _edited(paths["nvfp4"], tmp_path / "gone", state=lambda t: t.pop(victim))
    with pytest.raises(ModelFormatError, match="weight_global_scale.* is missing"):
        load_model(gone, experts_dtype="fp32")
    zero = _edited(paths["nvfp4"], tmp_path / "zero", state=lambda t: t[victim].zero_())
    with pytest.raises(ModelFormatError, match="finite, non-zero"):
        load_model(zero, cpu_only=True)
    scale = victim.replace("_global_scale", "_scale")
    short = _edited(paths["nvfp4"], tmp_path / "short", state=lambda t: t.update({scale: t[scale][:, :2].contiguous()}))
    with pytest.raises(ModelFormatError, match="needs .*weight_scale"):
        load_model(short, experts_dtype="fp32")
    other = _edited(paths["mxfp8"], tmp_path / "int8",
                    config=lambda q: [g.update(format="int-quantized") for g in q["config_groups"].values()])
    with pytest.raises(UnsupportedModelError, match="int-quantized.* not supported"):
        HfCheckpoint(other)
    fp8 = _edited(paths["modelopt"], tmp_path / "fp8", config=lambda q: q.update(quant_algo="FP8"))
    with pytest.raises(UnsupportedModelError, match="quant_algo 'FP8' is not supported"):
        HfCheckpoint(fp8)


def test_each_layout_converts_and_matches_its_reference(checkpoints, tmp_path, caplog):
    """``moed convert``: MXFP8 into a bf16 bank and bf16 weights, both exact, so the FTW model is the
    reference; NVFP4 with float32 experts and bf16 attention (one rounding, said in the log) within
    bf16's error."""
    from moed.weights.converter import convert_model

    family, paths, refs = checkpoints
    for layout, experts, tol in (("mxfp8", None, 1e-3), ("nvfp4", "fp32", 2e-2), ("modelopt", "fp32", 2e-2)):
        with caplog.at_level("WARNING", logger="moed.weights"):
            ftw = convert_model(paths[layout], tmp_path / layout, experts_dtype=experts)
        said = [r.getMessage() for r in caplog.records]
        assert any("decoded to bf16" in m for m in said) == (layout != "mxfp8"), said
        caplog.clear()
        runtime = open_runtime(ftw, weights_dtype="fp32")
        try:
            assert_matches_reference(runtime, refs[layout], tol=tol, tokens_equal=layout == "mxfp8",
                                     what=f"{family} {layout} ftw")
        finally:
            runtime.close()


def test_a_modelopt_export_with_only_hf_quant_config_is_nvfp4(checkpoints, tmp_path):
    """Older ModelOpt exports say NVFP4 only in hf_quant_config.json; config.json has no quantization_config."""
    from moed.weights.micro_scaled import MicroScaled

    _, paths, _ = checkpoints
    bare = _edited(paths["modelopt"], tmp_path / "bare")
    config = json.loads((bare / "config.json").read_text())
    del config["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    checkpoint = HfCheckpoint(bare)
    assert checkpoint.micro == MicroScaled("nvfp4", "modelopt") and checkpoint.prefers_ggml()
    (bare / "hf_quant_config.json").write_text("not json")
    with pytest.raises(ModelFormatError, match="hf_quant_config.json: not a ModelOpt quantization file"):
        HfCheckpoint(bare)


@pytest.mark.parametrize("layout", ["nvfp4", "modelopt", "mxfp8"])
def test_nvfp4_and_mxfp8_linears_stay_as_stored_on_the_cpu(checkpoints, layout):
    """A CPU-only load of an MLA model keeps its NVFP4 attention and dense linears block for block (llama.cpp
    NVFP4 rows and the tensor's factor, ``PackedLinear("nvfp4")``, 4.5 bits a weight; MXFP8 ones as moed's
    MXFP8 rows, 8.25 bits) and still matches transformers; so does a GQA model's (its decode chain multiplies
    the rows natively); a device load decodes them to bf16."""
    from moed.layers.packed_linear import PackedLinear
    from moed.models.decode_chain import DecodeChain

    family, paths, refs = checkpoints
    loaded = load_model(paths[layout], cpu_only=True)
    packed = {n: w for n, w in loaded.weights.items() if isinstance(w, PackedLinear)}
    kept = "mxfp8" if layout == "mxfp8" else "nvfp4"
    assert packed and {w.dtype for w in packed.values()} == {kept}
    assert any(n.endswith("self_attn.q_a_proj.weight" if family == "deepseek_v3" else "self_attn.q_proj.weight")
               for n in packed)
    w = next(iter(packed.values()))
    assert float(w.arrays[1]) > 0  # the tensor's factor (1 for MXFP8)
    if layout == "mxfp8":  # the rows hold the checkpoint's values exactly
        from moed.kernels.nvfp4_format import dequantize_mxfp8

        source = load_file(paths[layout] / "model.safetensors")
        name = next(n for n in packed)
        assert torch.equal(packed[name].dequantize(torch.float32), dequantize_mxfp8(source[name], source[name + "_scale"]))
    assert all(not isinstance(loaded.weights[n], PackedLinear) for n in loaded.weights if n.endswith("kv_b_proj.weight"))
    assert estimate_load(paths[layout], cpu_only=True).weight_bytes < estimate_load(paths[layout]).weight_bytes
    assert not any(isinstance(t, PackedLinear) for t in load_model(paths[layout], cpu_only=False).weights.values())
    runtime = open_runtime(paths[layout], experts_dtype="fp32")  # the CPU: linears kept, native kernels
    try:
        assert any(isinstance(t, PackedLinear) for t in runtime.loaded.weights.values())
        if family == "qwen3_moe":
            assert isinstance(runtime.model.decode_chain(), DecodeChain), runtime.model.decode_chain()
        # the kept linears multiply int8 activations (as a quantised GGUF's do): logits within 5% of their range
        assert_matches_reference(runtime, refs[layout], tol=0.05, tokens_equal=False, what=f"{family} {layout}")
    finally:
        runtime.close()


def test_nemotron_h_nvfp4_experts_hold_their_up_matrix_once(tmp_path):
    """Nemotron-H's relu^2 experts have no gate: kept as NVFP4 rows on the CPU, each layer's up matrix (and its
    factor) is held once under both names, the load estimate counts it once, and the model is transformers' on
    compressed-tensors' dequantised weights."""
    import transformers as tf

    build_tiny_model("nemotron_h", tmp_path / "src")
    path = write_compressed_tensors(tmp_path / "src", tmp_path / "nvfp4", "NVFP4A16")
    ref_dir = dequantised_reference(path, tmp_path / "ref", like=tmp_path / "src")
    reference = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    bank = load_model(path, cpu_only=True).bank
    assert bank.dtype == "ggml" and all(bank.gate_is_up(ml) for ml in range(bank.num_moe_layers))
    assert bank.tensors["gate.0.scale"] is bank.tensors["up.0.scale"]
    assert len(bank.storage()) == 4 * bank.num_moe_layers  # up, its factor, down, its factor
    assert estimate_load(path, cpu_only=True).bank_bytes == bank.nbytes()
    runtime = open_runtime(path, experts_dtype="ggml", weights_dtype="fp32")
    try:
        with without_native_kernels():
            assert_matches_reference(runtime, reference, tol=1e-3, steps=8, what="nemotron_h nvfp4 torch")
        if native() is not None:
            assert_matches_reference(runtime, reference, tol=10.0, tokens_equal=False, steps=1)  # runs natively
    finally:
        runtime.close()
