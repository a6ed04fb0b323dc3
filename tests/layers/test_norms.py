"""RMSNorm: the native decode path (native/cpu/norms.c) against the torch reference in norms.py."""

from __future__ import annotations

import pytest
import torch

import moed.layers.norms as norms
from moed.kernels.native_cpu import native

pytestmark = pytest.mark.skipif(native() is None, reason="native CPU kernels not built")


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 1, 37), (16, 5), (2, 1, 4, 8)])
def test_native_rms_norm_and_residual_add_match_torch(shape, wdtype, monkeypatch):
    gen = torch.Generator().manual_seed(shape[-1])
    x, delta = torch.randn(*shape, generator=gen) * 3, torch.randn(*shape, generator=gen)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(wdtype)
    calls = []
    real = native().add_rms_norm
    monkeypatch.setattr(native(), "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    got_h = norms.rms_norm(x, weight, 1e-6)
    got_x, got_h2 = norms.add_rms_norm(x, delta, weight, 1e-6)
    assert calls == [1, 1], "decode-sized norms did not take the native path"
    monkeypatch.setattr(norms, "native", lambda: None)
    torch.testing.assert_close(got_h, norms.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-6)
    want_x, want_h2 = norms.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(got_x, want_x)
    torch.testing.assert_close(got_h2, want_h2, rtol=1e-5, atol=1e-6)
    assert got_h.dtype == torch.float32 and got_h.shape == x.shape


def test_large_inputs_and_odd_layouts_use_torch(monkeypatch):
    monkeypatch.setattr(native(), "add_rms_norm", lambda *a: pytest.fail("native path for a prefill-sized norm"))
    norms.rms_norm(torch.randn(1, 64, 32), torch.ones(32), 1e-6)  # 64 rows > MAX_TOKENS
    norms.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6)  # not contiguous
    norms.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
