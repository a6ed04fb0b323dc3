"""quantize_int4 / dequantize_int4: layout, error bound, edge cases."""

from __future__ import annotations

import pytest
import torch

from moed.kernels.int4_format import INT4_GROUP_SIZE
from moed.kernels.int4_format import dequantize_int4, quantize_int4, unpack_int4


def test_shapes_and_dtypes() -> None:
    w = torch.randn(3, 64, 10)
    q, scale, mn = quantize_int4(w)
    assert q.dtype == torch.uint8 and tuple(q.shape) == (3, 64, 5)
    assert scale.dtype == mn.dtype == torch.bfloat16
    assert tuple(scale.shape) == tuple(mn.shape) == (3, 2, 10)
    assert q.is_contiguous() and scale.is_contiguous() and mn.is_contiguous()


def test_error_at_most_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(2, 96, 34) * torch.rand(2, 96, 34) * 3 + 5  # offset: min far from 0
    q, scale, mn = quantize_int4(w)
    err = (dequantize_int4(q, scale, mn) - w).abs()
    step = scale.float().repeat_interleave(INT4_GROUP_SIZE, dim=-2)
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-7).all())


def test_packing_low_nibble_is_column_j_high_is_j_plus_half() -> None:
    # Group 0 has levels 0..15 exactly when its min is 0 and its max 15 (scale 1).
    k, n = 32, 8
    levels = torch.randint(0, 16, (k, n)).float()
    levels[0] = 0.0
    levels[1] = 15.0
    q, scale, mn = quantize_int4(levels)
    assert torch.all(scale.float() == 1.0) and torch.all(mn.float() == 0.0)
    assert torch.equal(q & 0x0F, levels[:, : n // 2].to(torch.uint8))
    assert torch.equal(q >> 4, levels[:, n // 2 :].to(torch.uint8))
    assert torch.equal(unpack_int4(q), levels.to(torch.uint8))


def test_constant_group_is_exact() -> None:
    w = torch.full((32, 4), 1.2345)
    w[:, 2] = -3.0
    q, scale, mn = quantize_int4(w)
    assert torch.allclose(dequantize_int4(q, scale, mn), w, atol=1e-6, rtol=0)


def test_min_rounding_never_pushes_levels_past_the_group() -> None:
    # bf16 rounding of min/scale must still cover [min, max] of each group.
    torch.manual_seed(1)
    w = torch.randn(64, 6) * 1e-3 + 100.0
    q, scale, mn = quantize_int4(w)
    g = w.reshape(2, 32, 6)
    lo = mn.float()
    top = lo + 15 * scale.float()
    assert bool((lo <= g.amin(1)).all()) and bool((top >= g.amax(1)).all())


@pytest.mark.parametrize("shape", [(31, 4), (64, 3), (8,)])
def test_bad_shapes_raise(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        quantize_int4(torch.randn(*shape))


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="float32"):
        quantize_int4(torch.randn(32, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int4(torch.full((32, 4), float("nan")))
    q, scale, mn = quantize_int4(torch.randn(64, 4))
    with pytest.raises(ValueError, match="shape"):
        dequantize_int4(q, scale[:1], mn[:1])
    with pytest.raises(ValueError, match="bfloat16"):
        dequantize_int4(q, scale.float(), mn)
