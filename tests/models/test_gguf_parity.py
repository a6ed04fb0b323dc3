"""GGUF files in llama.cpp's layout run like transformers on the weights ``gguf.quants`` dequantises
from the same file (issue #10): Qwen3-MoE, Qwen2-MoE and gpt-oss; F32/F16/BF16/Q8_0 (and MXFP4
experts) give the same greedy tokens, the 4-bit types logits within a stated tolerance."""

from __future__ import annotations

import contextlib

import pytest
import torch
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import load_dequantised_into, write_tiny_gguf
from helpers.native_switch import without_native_kernels
from helpers.reference_parity import assert_matches_reference
from moed.engine.runtime import open_runtime
from moed.weights.converter import convert_model

STEPS = 12
EXACT_TOL = 1e-3  # float32 summation order only: the weights are exactly what gguf.quants decodes
# (expert type, other 2-D weights' type, the bank dtype moed picks by default)
EXACT = [(T.F32, T.F32, "fp32"), (T.F16, T.F16, "fp32"), (T.BF16, T.BF16, "bf16"), (T.Q8_0, T.Q8_0, "q8")]


def _compare(path, reference, *, tol: float, tokens_equal: bool, bank_dtype: str, native: bool | None = None,
             **load):
    """``native``: run the experts on the native kernels (int8 activations for quantised banks); by
    default only where the check is not an exact one (exact checks run the float32-activation kernels)."""
    runtime = open_runtime(path, weights_dtype="fp32", **load)
    if native is None:
        native = tol > EXACT_TOL or bank_dtype in ("fp32", "bf16")
    try:
        assert runtime.loaded.format == "gguf" and runtime.loaded.bank.dtype == bank_dtype
        assert runtime.tokenizer is not None  # built from the GGUF metadata
        with contextlib.nullcontext() if native else without_native_kernels():
            return assert_matches_reference(runtime, reference, tol=tol, tokens_equal=tokens_equal, steps=STEPS,
                                            seed=3)
    finally:
        runtime.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("expert_type,weight_type,bank_dtype", EXACT, ids=lambda v: getattr(v, "name", v))
def test_gguf_matches_transformers_on_the_dequantised_weights(family, expert_type, weight_type, bank_dtype, tmp_path):
    path, _, model = write_tiny_gguf(family, tmp_path, expert_type=expert_type, weight_type=weight_type)
    load_dequantised_into(model, family, path)
    _compare(path, model.eval(), tol=EXACT_TOL, tokens_equal=True, bank_dtype=bank_dtype)


def test_gpt_oss_mxfp4_gguf_keeps_its_experts_and_matches(tmp_path):
    path, _, model = write_tiny_gguf("gpt_oss", tmp_path, expert_type=T.MXFP4, weight_type=T.Q8_0)
    load_dequantised_into(model, "gpt_oss", path)
    _compare(path, model.eval(), tol=EXACT_TOL, tokens_equal=True, bank_dtype="mxfp4")


# The native kernels quantise the activations of q8 / mxfp4 / int4 experts to int8 per 32 values, as
# llama.cpp does for its quantised types: about 1/254 of each group's largest value per activation.
INT8_ACTIVATION_TOL = 2e-2


@pytest.mark.parametrize("family,expert_type,bank_dtype", [("qwen3_moe", T.Q8_0, "q8"), ("gpt_oss", T.MXFP4, "mxfp4")])
def test_native_int8_activation_experts_stay_within_their_tolerance(family, expert_type, bank_dtype, tmp_path):
    path, _, model = write_tiny_gguf(family, tmp_path, expert_type=expert_type, weight_type=T.Q8_0)
    load_dequantised_into(model, family, path)
    _compare(path, model.eval(), tol=INT8_ACTIVATION_TOL, tokens_equal=False, bank_dtype=bank_dtype, native=True)


# 4-bit GGUF types kept as int4 codes: only the bf16 rounding of each group's scale and min
# differs from the reference (<= 2^-8 (15 |scale| + |min|) per weight, gguf_quants.to_int4_bank),
# a logit error of a few parts in a thousand of the logits' range here.
FOUR_BIT_TOL = 2e-2


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("expert_type", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_four_bit_gguf_runs_as_int4_within_the_stated_tolerance(family, expert_type, tmp_path):
    path, _, model = write_tiny_gguf(family, tmp_path, expert_type=expert_type, weight_type=T.Q8_0)
    load_dequantised_into(model, family, path)
    _compare(path, model.eval(), tol=FOUR_BIT_TOL, tokens_equal=False, bank_dtype="int4")


def test_k_quant_gguf_runs_within_the_stated_tolerance(tmp_path):
    """Q4_K experts (random valid blocks: gguf.quants cannot quantise K-quants) keep their codes in
    an int4 bank: the same tolerance as the other 4-bit types."""
    path, _, model = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q4_K, weight_type=T.Q8_0,
                                     hidden_size=256, moe_intermediate_size=256)
    load_dequantised_into(model, "qwen3_moe", path)
    _compare(path, model.eval(), tol=FOUR_BIT_TOL, tokens_equal=False, bank_dtype="int4")


def test_q4_k_m_mix_loads_as_stored_on_the_cpu_and_the_re_quantised_banks_lose_more(tmp_path):
    """Q4_K_M's mix: Q4_K gate/up with Q6_K down. On the CPU the default keeps every tensor as stored
    (the ggml bank: nothing re-quantised); ``--experts-dtype int4`` keeps the Q4_K codes and
    re-quantises the Q6_K rows to 4 bits, q8 keeps more of them, fp32 all. Random Q6_K blocks (all 64
    levels, random sub-block scales) are the worst case for re-quantisation, so only the order is
    asserted there, and exactness for fp32."""
    types = {f"blk.{i}.ffn_down_exps.weight": T.Q6_K for i in range(3)}
    path, _, model = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q4_K, weight_type=T.Q8_0,
                                     tensor_types=types, hidden_size=256, moe_intermediate_size=256)
    load_dequantised_into(model, "qwen3_moe", path)
    exact = _compare(path, model.eval(), tol=EXACT_TOL, tokens_equal=True, bank_dtype="fp32", experts_dtype="fp32")
    kept = _compare(path, model.eval(), tol=10.0, tokens_equal=False, bank_dtype="ggml")  # the CPU default
    q8 = _compare(path, model.eval(), tol=1.0, tokens_equal=False, bank_dtype="q8", experts_dtype="q8")
    int4 = _compare(path, model.eval(), tol=10.0, tokens_equal=False, bank_dtype="int4", experts_dtype="int4")
    assert exact < kept < int4 and exact < q8 < int4


def test_gguf_converts_to_ftw_that_loads_the_same(tmp_path):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q8_0, weight_type=T.BF16)
    dst = convert_model(path, tmp_path / "ftw")
    src, ftw = open_runtime(path), open_runtime(dst)
    try:
        assert ftw.loaded.bank.dtype == "q8" and ftw.loaded.format == "ftw"
        assert sorted(src.loaded.weights) == sorted(ftw.loaded.weights)
        for name, t in src.loaded.weights.items():
            assert ftw.loaded.weights[name].dtype == t.dtype and torch.equal(ftw.loaded.weights[name], t), name
        for name, t in src.loaded.bank.tensors.items():
            assert torch.equal(ftw.loaded.bank.tensors[name], t), name
        text = "The router reads the weights."
        assert src.tokenizer.encode(text) == ftw.tokenizer.encode(text)
        messages = [{"role": "user", "content": "hi"}]
        assert (src.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                == ftw.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    finally:
        src.close()
        ftw.close()
