"""run_expert (numba) against run_expert_reference (torch) and against a plain nn.Linear SwiGLU MLP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.native_switch import without_native_kernels
from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation, ExpertBank
from moed.experts.expert_ffn import run_expert, run_expert_reference
from moed.kernels.expert_matmul import DIRECT_MAX_TOKENS
from moed.kernels.native_cpu import MAX_TOKENS as NATIVE_MAX_TOKENS
from moed.kernels.native_cpu import native
from moed.kernels.native_cpu_reference import routed_reference

D, I, LAYERS, EXPERTS = 64, 96, 2, 3


def _bank(dtype: str, kind: str, bias: bool, seed: int = 0) -> ExpertBank:
    gen = torch.Generator().manual_seed(seed)
    n = LAYERS * EXPERTS
    gate_up = torch.randn(n, D, 2 * I, generator=gen) / D**0.5
    down = torch.randn(n, I, D, generator=gen) / I**0.5
    biases = {}
    if bias:
        biases = dict(gate_up_bias=torch.randn(n, 2 * I, generator=gen), down_bias=torch.randn(n, D, generator=gen))
    return build_expert_bank(
        gate_up * 4,  # large enough that the clamps (gpt_oss, clamped_silu) are hit
        down,
        num_moe_layers=LAYERS,
        num_experts=EXPERTS,
        dtype=dtype,
        activation=ExpertActivation(kind),
        **biases,
    )


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int4", "q8", "mxfp4"])
@pytest.mark.parametrize("kind,bias", [("silu", False), ("gpt_oss", True), ("silu", True), ("clamped_silu", True),
                                       ("relu2", False), ("gelu_tanh", True)])
def test_matches_reference(dtype: str, kind: str, bias: bool, tokens: int) -> None:
    bank = _bank(dtype, kind, bias)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    int8_activations = native() is not None and dtype in ("int4", "q8", "mxfp4") and tokens <= NATIVE_MAX_TOKENS
    for fid in (0, bank.flat_id(1, 2)):
        y = run_expert(bank, fid, x)
        assert y.shape == (tokens, D) and y.dtype == torch.float32
        if int8_activations:  # the native kernels' int8 activations: checked against their twin's bound
            want, tol = routed_reference(bank, x, torch.full((tokens, 1), fid), torch.ones(tokens, 1))
            assert bool(((y.double() - want).abs() <= tol).all())
            continue
        ref = run_expert_reference(bank, fid, x)
        tol = _prefill_tol(dtype, tokens)
        torch.testing.assert_close(y, ref, rtol=tol, atol=tol * float(ref.abs().max()))


def _prefill_tol(dtype: str, tokens: int) -> float:
    """Prefill (more than DIRECT_MAX_TOKENS tokens) multiplies every bank but fp32 in bf16: x, weights,
    gate_up and down outputs rounded to bf16 (2**-9 each), through two GEMMs and the activation."""
    return 2.0**-6 if tokens > DIRECT_MAX_TOKENS and dtype != "fp32" else 1e-4


@pytest.mark.parametrize("tokens", [1, 4, 20])
def test_mxfp4_from_gpt_oss_blocks_matches_transformers_expert(tokens: int) -> None:
    """A gpt-oss MXFP4 checkpoint's expert, repacked into an mxfp4 bank, against transformers' own
    GptOssExperts arithmetic on transformers' dequantisation of the same blocks (gate/up interleaved)."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    from moed.kernels.mxfp4_format import from_gpt_oss_blocks, to_gpt_oss_blocks

    gen = torch.Generator().manual_seed(5)
    e = 2
    gu_blocks, gu_scales = to_gpt_oss_blocks(torch.randn(e, 2 * I, D, generator=gen) / D**0.5 * 4)  # rows 2I, K = D
    dn_blocks, dn_scales = to_gpt_oss_blocks(torch.randn(e, D, I, generator=gen) / I**0.5)  # rows D, K = I
    gu_bias, dn_bias = torch.randn(e, 2 * I, generator=gen), torch.randn(e, D, generator=gen)
    config = GptOssConfig(hidden_size=D, intermediate_size=I, num_local_experts=e)
    experts = gpt_oss.GptOssExperts(config)
    w_gu = mxfp4.convert_moe_packed_tensors(gu_blocks, gu_scales, dtype=torch.float32)  # [E, D, 2I]
    w_dn = mxfp4.convert_moe_packed_tensors(dn_blocks, dn_scales, dtype=torch.float32)  # [E, I, D]

    order = torch.cat([torch.arange(0, 2 * I, 2), torch.arange(1, 2 * I, 2)])  # gate rows, then up rows
    gu_fp4, gu_e8 = from_gpt_oss_blocks(gu_blocks[:, order].contiguous(), gu_scales[:, order].contiguous())
    dn_fp4, dn_e8 = from_gpt_oss_blocks(dn_blocks, dn_scales)
    bank = ExpertBank(
        num_moe_layers=1, num_experts=e, hidden_size=D, intermediate_size=I, dtype="mxfp4",
        activation=ExpertActivation("gpt_oss", alpha=experts.alpha, limit=experts.limit),
        tensors={"gate_up.fp4": gu_fp4, "gate_up.e8m0": gu_e8, "down.fp4": dn_fp4, "down.e8m0": dn_e8,
                 "gate_up_bias": gu_bias[:, order].contiguous(), "down_bias": dn_bias},
    )
    x = torch.randn(tokens, D, generator=gen)
    for fid in range(e):
        with torch.no_grad():
            want = experts._apply_gate(x @ w_gu[fid] + gu_bias[fid]) @ w_dn[fid] + dn_bias[fid]
        assert float((x @ w_gu[fid] + gu_bias[fid]).abs().max()) > experts.limit  # clamps are exercised
        with without_native_kernels():  # float32 activations: the repacked bits must give transformers' numbers
            got = run_expert(bank, fid, x)
        tol = _prefill_tol("mxfp4", tokens)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
        torch.testing.assert_close(run_expert_reference(bank, fid, x), want, rtol=1e-5,
                                   atol=1e-5 * float(want.abs().max()))


def test_gpt_oss_clamps_are_exercised() -> None:
    bank = _bank("fp32", "gpt_oss", True)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    h = x @ bank.tensors["gate_up"][0] + bank.tensors["gate_up_bias"][0]
    assert float(h.abs().max()) > bank.activation.limit


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fp32_silu_matches_nn_linear_mlp(tokens: int) -> None:
    """Independent of the reference: a SwiGLU MLP from nn.Linear weights, transposed to k-major."""
    torch.manual_seed(0)
    gate, up, down = nn.Linear(D, I, bias=False), nn.Linear(D, I, bias=False), nn.Linear(I, D, bias=False)
    gate_up = torch.cat([gate.weight.T, up.weight.T], dim=1).detach()  # [D, 2I], gate columns first
    bank = build_expert_bank(
        gate_up.unsqueeze(0).contiguous(),
        down.weight.T.detach().unsqueeze(0).contiguous(),
        num_moe_layers=1,
        num_experts=1,
        dtype="fp32",
        activation=ExpertActivation("silu"),
    )
    x = torch.randn(tokens, D)
    with torch.no_grad():
        want = down(F.silu(gate(x)) * up(x))
    torch.testing.assert_close(run_expert(bank, 0, x), want, rtol=1e-5, atol=1e-5)


def test_views_follow_replaced_tensors() -> None:
    bank = _bank("bf16", "silu", False)
    x = torch.randn(1, D)
    before = run_expert(bank, 0, x)
    bank.tensors["down"] = (bank.tensors["down"].float() * 2).to(torch.bfloat16)
    torch.testing.assert_close(run_expert(bank, 0, x), before * 2)


def test_bad_inputs_raise() -> None:
    bank = _bank("int4", "silu", False)
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        run_expert(bank, 0, torch.randn(1, D + 1))
    with pytest.raises(ValueError, match="float32"):
        run_expert(bank, 0, torch.randn(1, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="out of range"):
        run_expert(bank, LAYERS * EXPERTS, torch.randn(1, D))
    with pytest.raises(ValueError, match="out of range"):
        run_expert_reference(bank, -1, torch.randn(1, D))
    del bank.tensors["down.min"]
    with pytest.raises(ValueError, match="down.min"):
        run_expert(bank, 0, torch.randn(1, D))


def test_non_contiguous_x_is_accepted() -> None:
    bank = _bank("fp32", "silu", False)
    x = torch.randn(D, 2).t()
    torch.testing.assert_close(run_expert(bank, 1, x), run_expert_reference(bank, 1, x.contiguous()))
