"""gpt-oss checkpoints with MXFP4 experts (its shipping layout: ``*_blocks`` + ``*_scales``) load into an
mxfp4 bank bit for bit and match transformers run on the weights transformers' own MXFP4 code
dequantises (issue #10)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.native_switch import without_native_kernels
from helpers.reference_parity import assert_matches_reference
from helpers.tiny_models import build_tiny_model
from moed.engine.runtime import open_runtime
from moed.errors import ModelFormatError
from moed.kernels.mxfp4_format import to_gpt_oss_blocks
from moed.weights.converter import convert_model

EXPERTS = "model.layers.{i}.mlp.experts."


def _reference_dequantise(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    src = tmp_path_factory.mktemp("gpt_oss-f32")
    build_tiny_model("gpt_oss", src)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    quantised, dequantised = dict(tensors), dict(tensors)
    for i in range(config["num_hidden_layers"]):
        for proj in ("gate_up_proj", "down_proj"):
            key = EXPERTS.format(i=i) + proj
            w = tensors[key]  # [E, K, rows] as transformers keeps it
            blocks, scales = to_gpt_oss_blocks(w.transpose(1, 2).contiguous())  # [E, rows, K/32, 16], [E, rows, K/32]
            del quantised[key]
            quantised[key + "_blocks"], quantised[key + "_scales"] = blocks, scales
            ref = _reference_dequantise(blocks, scales)
            assert ref.shape == w.shape
            assert (ref - w).abs().max() < 0.25 * w.abs().max()  # the packer is a sane MXFP4 quantiser
            dequantised[key] = ref.contiguous()
    dst = tmp_path_factory.mktemp("gpt_oss-mxfp4")
    save_file(quantised, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}))
    ref_dir = tmp_path_factory.mktemp("gpt_oss-dequantised")
    save_file(dequantised, ref_dir / "model.safetensors")
    (ref_dir / "config.json").write_text(json.dumps(config))
    import transformers as tf

    reference = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="eager")
    return dst, reference.eval(), dequantised


def test_mxfp4_experts_load_bit_for_bit_and_match_transformers(mxfp4_model):
    path, reference, dequantised = mxfp4_model
    runtime = open_runtime(path, weights_dtype="fp32")
    try:
        bank = runtime.loaded.bank
        assert bank.dtype == "mxfp4"  # the default keeps the checkpoint's own format
        from moed.cache.bank_builder import dequantize_bank_rows

        gate_up, down = dequantize_bank_rows(bank.tensors, "mxfp4")
        e = bank.num_experts
        for i in range(bank.num_moe_layers):
            ref_gu = dequantised[EXPERTS.format(i=i) + "gate_up_proj"]  # [E, D, 2I], gate/up interleaved
            assert torch.equal(gate_up[i * e:(i + 1) * e], torch.cat([ref_gu[..., 0::2], ref_gu[..., 1::2]], -1))
            assert torch.equal(down[i * e:(i + 1) * e], dequantised[EXPERTS.format(i=i) + "down_proj"])
        with without_native_kernels():  # float32 activations: the loaded bits must give transformers' logits
            assert_matches_reference(runtime, reference, tol=1e-3)
        assert_matches_reference(runtime, reference, tol=2e-2, tokens_equal=False)  # int8 activations (native)
    finally:
        runtime.close()


def test_mxfp4_converts_to_ftw_unchanged_and_widens_to_bf16_exactly(mxfp4_model, tmp_path):
    path, _, _ = mxfp4_model
    hf = open_runtime(path)
    ftw = open_runtime(convert_model(path, tmp_path / "ftw"))
    wide = open_runtime(path, experts_dtype="bf16")  # E2M1 x 2^e is exact in bf16
    try:
        assert ftw.loaded.bank.dtype == "mxfp4"
        for name, t in hf.loaded.bank.tensors.items():
            assert torch.equal(ftw.loaded.bank.tensors[name], t), name
        from moed.cache.bank_builder import dequantize_bank_rows

        a = dequantize_bank_rows(hf.loaded.bank.tensors, "mxfp4")
        b = dequantize_bank_rows(wide.loaded.bank.tensors, "bf16")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    finally:
        for r in (hf, ftw, wide):
            r.close()


def test_mxfp4_with_a_missing_scale_tensor_or_config_is_one_clear_error(mxfp4_model, tmp_path):
    path, _, _ = mxfp4_model
    tensors = load_file(path / "model.safetensors")
    broken = tmp_path / "no-scales"
    broken.mkdir()
    missing = EXPERTS.format(i=1) + "down_proj_scales"
    save_file({k: v for k, v in tensors.items() if k != missing}, broken / "model.safetensors")
    (broken / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelFormatError, match="down_proj_scales.*missing") as info:
        open_runtime(broken)
    assert "\n" not in str(info.value)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (broken / "config.json").write_text(json.dumps(config))
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelFormatError, match="quantization_config is not mxfp4"):
        open_runtime(broken)
