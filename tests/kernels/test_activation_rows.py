"""The per-row helpers of the native MoE calls at every ISA: the int8 activation quantiser (byte for byte the
torch twin's) and the experts' activation (the scalar code, libm's, and the torch activations of
``apply_activation`` as references)."""

from __future__ import annotations

import pytest
import torch

from moed.cache.host_bank import ExpertActivation
from moed.experts.expert_ffn import apply_activation
from moed.kernels.native_cpu import ACT_CODES, native
from moed.kernels.native_cpu_reference import quantize_activations


def _lib():
    lib = native()
    if lib is None:
        pytest.skip("the native CPU kernels are not built")
    return lib


def _hard_rows(k: int) -> torch.Tensor:
    """Rows the quantiser can get wrong: ties at .5 (amax 127 makes the scale 1), an all-zero group, tiny
    and huge magnitudes, a lone outlier, random values."""
    gen = torch.Generator().manual_seed(7)
    ties = (torch.arange(k, dtype=torch.float32) % 255 - 127) + 0.5
    ties[::32] = 127.0
    zeros = torch.randn(k, generator=gen)
    zeros[32:64] = 0.0
    outlier = torch.randn(k, generator=gen) * 1e-3
    outlier[5] = 40.0
    return torch.stack([ties.clamp(-127, 127), zeros, torch.randn(k, generator=gen) * 1e-30,
                        torch.randn(k, generator=gen) * 1e30, outlier, torch.randn(k, generator=gen)])


@pytest.mark.parametrize("span", [32, 256])
def test_the_quantiser_makes_the_twins_bytes_at_every_isa(span):
    lib = _lib()
    x = _hard_rows(512)
    want = quantize_activations(x, span)
    for isa in lib.available_isas():
        xq, xs, xsum = lib.quantize_act_span(x, span, isa)
        assert torch.equal(xq, want[0]), isa
        assert torch.equal(xs, want[1]), isa
        assert torch.equal(xsum.double(), want[2]), isa


def test_the_quantiser_refuses_a_bad_span():
    lib = _lib()
    with pytest.raises(ValueError, match="span"):
        lib.quantize_act_span(torch.randn(1, 96), 64, "scalar")
    with pytest.raises(ValueError, match="span"):
        lib.quantize_act_span(torch.randn(1, 288), 256, "scalar")


def _activation_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(n, generator=gen) * 4
    g[:8] = torch.tensor([-100.0, -88.5, -30.0, -1e-6, 0.0, 1e-6, 30.0, 100.0])  # past exp's range both ways
    u = torch.randn(n, generator=gen) * 3
    return g, u


@pytest.mark.parametrize("kind", list(ACT_CODES))
def test_the_activation_matches_torch_and_the_scalar_code_at_every_isa(kind):
    lib = _lib()
    n = 203  # 25 vectors of eight and a tail of three
    g, u = _activation_inputs(n)
    bg, bu = torch.randn(n) * 0.1, torch.randn(n) * 0.1
    sg, su = 1.5, 0.75
    act = ExpertActivation(kind=kind, alpha=1.702, limit=7.0)
    gate, up = (g * sg + bg).double(), (u * su + bu).double()
    want = apply_activation(torch.cat([gate, up])[None], act)[0]
    scalar = lib.activate_row(ACT_CODES[kind], g, u, "scalar", sg=sg, su=su, bg=bg, bu=bu, alpha=act.alpha,
                              limit=act.limit)
    for isa in lib.available_isas():
        h = lib.activate_row(ACT_CODES[kind], g, u, isa, sg=sg, su=su, bg=bg, bu=bu, alpha=act.alpha,
                             limit=act.limit)
        assert torch.isfinite(h).all(), isa
        # a few float32 ulps of the value, or of gate x up where the value is a small difference (libm's
        # GeGLU takes 1 + tanh(z) with tanh(z) near -1)
        tol = 4e-6 * want.abs() + 2e-7 * (gate.abs() + 1) * up.abs()
        assert ((h.double() - want).abs() <= tol).all(), (isa, (h.double() - want).abs().max().item())
        assert ((h.double() - scalar.double()).abs() <= 2 * tol).all(), isa


def test_the_activation_without_biases_and_scales():
    lib = _lib()
    g, u = _activation_inputs(16)
    for isa in lib.available_isas():
        h = lib.activate_row(ACT_CODES["silu"], g, u, isa)
        torch.testing.assert_close(h, torch.nn.functional.silu(g) * u, rtol=4e-6, atol=1e-6)

