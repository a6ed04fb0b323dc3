"""The prefill GEMM's dtype: bf16 only where this CPU's oneDNN runs it natively, float32 elsewhere.

Both branches run on every machine (the CPU's answer is patched), at the three places that multiply
many tokens: a bank expert (expert_matmul), a bf16 projection (linear) and a packed projection
(PackedLinear). The float32 branch must be float32-exact (a bf16 rounding of x would break the
tight bound); the bf16 branch must return bf16 values (its GEMM's output dtype) within the bf16
rounding bound. No bit-for-bit comparison of two GEMMs: oneDNN may block them differently.
"""

from __future__ import annotations

import pytest
import torch

import moed.kernels.prefill_gemm as pg
from moed.kernels.expert_matmul import DIRECT_MAX_TOKENS, expert_matmul
from moed.kernels.q8_format import dequantize_q8, quantize_q8
from moed.layers.linear import linear
from moed.layers.packed_linear import PackedLinear

T, K, N = DIRECT_MAX_TOKENS + 24, 96, 64


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(T, K, generator=torch.Generator().manual_seed(seed))


def _fp32_close(y: torch.Tensor, exact: torch.Tensor, x: torch.Tensor, w_kn: torch.Tensor) -> bool:
    """float32 accumulation only: far below one bf16 rounding of x (2^-9 relative)."""
    bound = 1e-5 * (x.double().abs() @ w_kn.double().abs()) + 1e-30
    return bool(((y.double() - exact).abs() <= bound).all())


def _bf16_gemm_like(y: torch.Tensor, x: torch.Tensor, w_kn: torch.Tensor) -> bool:
    """A bf16 GEMM's result: every value a bf16 number, within the rounding of x, w and y to bf16."""
    exact = x.bfloat16().double() @ w_kn.bfloat16().double()
    bound = 2.0**-8 * exact.abs() + 1e-5 * (x.double().abs() @ w_kn.double().abs()) + 1e-30
    return torch.equal(y, y.bfloat16().float()) and bool(((y.double() - exact).abs() <= bound).all())


def test_the_answer_is_torchs_own_and_never_touches_other_devices():
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert pg.prefill_gemm_dtype(torch.bfloat16, torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert pg.prefill_gemm_dtype(torch.float32, torch.device("cpu")) == torch.float32
    assert pg.prefill_gemm_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert pg.prefill_gemm_dtype(torch.float16, torch.device("cuda")) == torch.float16


@pytest.mark.parametrize("fast", [True, False], ids=["bf16-gemm", "fp32-gemm"])
def test_bank_expert_prefill(fast, monkeypatch):
    monkeypatch.setattr(pg, "_cpu_runs_natively", lambda dtype: fast)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2, K, N, generator=gen)  # [E, K, N] k-major
    x = _x(1)
    bf16_bank = {"down": w.to(torch.bfloat16)}
    qs, d = quantize_q8(w)
    q8_bank = {"down.qs": qs, "down.d": d}
    for bank, w_f32 in ((bf16_bank, w.to(torch.bfloat16).float()), (q8_bank, dequantize_q8(qs, d))):
        y = expert_matmul(bank, "down", 1, x)
        exact = x.double() @ w_f32[1].double()
        if fast:
            assert _bf16_gemm_like(y, x, w_f32[1])
        else:
            assert _fp32_close(y, exact, x, w_f32[1])


@pytest.mark.parametrize("fast", [True, False], ids=["bf16-gemm", "fp32-gemm"])
def test_bf16_projection_prefill(fast, monkeypatch):
    monkeypatch.setattr(pg, "_cpu_runs_natively", lambda dtype: fast)
    weight = torch.randn(N, K, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x = _x(2)
    y = linear(x, weight)
    if fast:
        assert _bf16_gemm_like(y, x, weight.float().t())
    else:
        assert _fp32_close(y, x.double() @ weight.double().t(), x, weight.float().t())


@pytest.mark.parametrize("fast", [True, False], ids=["bf16-gemm", "fp32-gemm"])
def test_packed_projection_prefill(fast, monkeypatch):
    monkeypatch.setattr(pg, "_cpu_runs_natively", lambda dtype: fast)
    w_kn = torch.randn(1, K, N, generator=torch.Generator().manual_seed(7))
    qs, d = quantize_q8(w_kn)
    weight = PackedLinear.from_kn("q8", (qs[0], d[0]), K, N)
    x = _x(3)
    y = weight.matmul(x)
    w_f32 = dequantize_q8(qs, d)[0]  # [K, N]
    if fast:
        assert _bf16_gemm_like(y, x, w_f32)
    else:
        assert _fp32_close(y, x.double() @ w_f32.double(), x, w_f32)
