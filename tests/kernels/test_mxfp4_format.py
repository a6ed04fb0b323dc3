"""MXFP4: quantiser and dequantiser, and gpt-oss's block layout against transformers' own dequantiser."""

from __future__ import annotations

import pytest
import torch

from moed.kernels.mxfp4_format import (
    E2M1_VALUES,
    dequantize_mxfp4,
    e2m1_values,
    e8m0_scale,
    from_gpt_oss_blocks,
    quantize_mxfp4,
    to_gpt_oss_blocks,
)

GRID = torch.tensor(sorted(set(abs(v) for v in E2M1_VALUES)))  # 0, .5, 1, 1.5, 2, 3, 4, 6


def _transformers_dequant():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    return mxfp4.convert_moe_packed_tensors


def _random_gpt_oss(e: int, rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, rows, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (e, rows, k // 32), dtype=torch.uint8, generator=gen)
    scales[0, 0, 0] = 0  # the subnormal scale 2**-127
    scales[-1, -1, -1] = 254  # the largest finite one
    blocks[-1, -1, -1] &= 0x55  # with small codes there, so the weights stay finite
    return blocks, scales


def test_shapes_and_dtypes() -> None:
    fp4, e8m0 = quantize_mxfp4(torch.randn(3, 64, 10))
    assert fp4.dtype == e8m0.dtype == torch.uint8
    assert tuple(fp4.shape) == (3, 64, 5) and tuple(e8m0.shape) == (3, 2, 10)
    assert fp4.is_contiguous() and e8m0.is_contiguous()


def test_codes_decode_to_the_e2m1_table() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_values(codes).tolist() == list(E2M1_VALUES)
    assert e8m0_scale(torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)).tolist() == [
        2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]


def test_values_on_the_grid_round_trip_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    k, n = 64, 12
    signs = torch.where(torch.rand(k, n, generator=gen) < 0.5, -1.0, 1.0)
    w = GRID[torch.randint(0, 8, (k, n), generator=gen)] * signs
    w[0] = 6.0  # every group's largest magnitude is 6: shared exponent 0
    e = torch.randint(-20, 20, (k // 32, n), generator=gen).float()
    w = w * torch.exp2(e).repeat_interleave(32, 0)  # a power-of-two scale per group
    fp4, e8m0 = quantize_mxfp4(w)
    assert torch.equal(e8m0.int() - 127, e.int())
    assert torch.equal(dequantize_mxfp4(fp4, e8m0), w)


def test_quantiser_picks_the_nearest_grid_value() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4, 96, 34, generator=gen) * torch.exp2(torch.randint(-8, 8, (4, 1, 34), generator=gen).float())
    fp4, e8m0 = quantize_mxfp4(w)
    deq = dequantize_mxfp4(fp4, e8m0)
    amax = w.reshape(4, 3, 32, 34).abs().amax(2)
    scale = e8m0_scale(e8m0)
    # shared exponent = floor(log2(amax)) - 2: the group's largest weight lands in [4, 8)
    ratio = amax / scale
    assert bool(((ratio >= 4) & (ratio < 8)).all())
    a = (w / scale.repeat_interleave(32, 1)).abs()  # [4, 96, 34]
    dist = (a.unsqueeze(-1) - GRID).abs()  # [4, 96, 34, 8]
    best = GRID[dist.argmin(-1)]
    got = (deq / scale.repeat_interleave(32, 1)).abs()
    # nearest grid magnitude (ties may go either way: compare distances, not values)
    assert bool(((got - a).abs() <= (best - a).abs() + 1e-6).all())
    assert bool((torch.sign(deq) * torch.sign(w) >= 0).all())
    assert bool(((deq - w).abs() < 2 * scale.repeat_interleave(32, 1)).all())  # clamping at 6 costs < 2 steps


def test_ties_go_to_the_even_mantissa() -> None:
    w = torch.zeros(32, 1)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    w[: ties.numel(), 0] = ties
    w[-1, 0] = 6.0  # scale 1
    fp4, e8m0 = quantize_mxfp4(torch.cat([w, w], dim=1))
    deq = dequantize_mxfp4(fp4, e8m0)[: ties.numel(), 0]
    assert deq.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_zero_group_tiny_and_huge_weights() -> None:
    w = torch.zeros(96, 2)
    w[32:64, 0] = 1e-42  # subnormal float32: the exponent clamps at e8m0's smallest
    w[64:, 1] = 1e38
    w[64, 1] = 3e38
    fp4, e8m0 = quantize_mxfp4(w)
    assert int(fp4[:32].max()) == 0 and int(e8m0[0].max()) == 0  # all-zero group: codes 0, exponent 0
    assert int(e8m0[1, 0]) == 0
    deq = dequantize_mxfp4(fp4, e8m0)
    assert bool(torch.isfinite(deq).all())
    assert float(deq[64, 1]) == pytest.approx(3e38, rel=0.25) and float(deq[70, 1]) == pytest.approx(1e38, rel=0.25)


def test_packing_low_nibble_is_column_j_high_is_j_plus_half() -> None:
    w = torch.zeros(32, 4)
    w[0] = torch.tensor([6.0, 0.5, -1.0, 3.0])
    w[1] = 6.0  # every column's largest weight is 6: exponent 0 (e8m0 127)
    fp4, e8m0 = quantize_mxfp4(w)
    assert torch.equal(e8m0, torch.full((1, 4), 127, dtype=torch.uint8))
    # codes: 6 -> 7, 0.5 -> 1, -1 -> 8 | 2, 3 -> 5
    assert fp4[0].tolist() == [7 | (10 << 4), 1 | (5 << 4)]
    swapped = (fp4 >> 4) | (fp4 << 4)
    assert not torch.equal(dequantize_mxfp4(swapped, e8m0), dequantize_mxfp4(fp4, e8m0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_repack_equals_transformers_dequantisation(dtype: torch.dtype) -> None:
    convert = _transformers_dequant()
    blocks, scales = _random_gpt_oss(3, 10, 96, seed=2)
    want = convert(blocks, scales, dtype=dtype)  # [E, K, rows]: transformers returns it k-major
    assert tuple(want.shape) == (3, 96, 10)
    fp4, e8m0 = from_gpt_oss_blocks(blocks, scales)
    assert tuple(fp4.shape) == (3, 96, 5) and tuple(e8m0.shape) == (3, 3, 10)
    got = dequantize_mxfp4(fp4, e8m0)
    assert torch.equal(got.to(dtype), want)
    if dtype == torch.float32:
        assert torch.equal(got, want)


def test_gpt_oss_repack_is_sensitive_to_nibble_order_and_orientation() -> None:
    convert = _transformers_dequant()
    blocks, scales = _random_gpt_oss(2, 8, 64, seed=3)
    want = convert(blocks, scales, dtype=torch.float32)
    swapped = (blocks >> 4) | (blocks << 4)  # element 2b <-> 2b + 1
    assert not torch.equal(dequantize_mxfp4(*from_gpt_oss_blocks(swapped, scales)), want)
    fp4, e8m0 = from_gpt_oss_blocks(blocks, scales)
    assert not torch.equal(dequantize_mxfp4(fp4, e8m0.flip(-1)), want)  # scales belong to their row


def test_to_gpt_oss_blocks_round_trips_through_transformers() -> None:
    convert = _transformers_dequant()
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2, 7, 64, generator=gen)  # [E, rows, K]; an odd row count is fine in this layout
    blocks, scales = to_gpt_oss_blocks(w)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert tuple(blocks.shape) == (2, 7, 2, 16) and tuple(scales.shape) == (2, 7, 2)
    got = convert(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    # the same quantisation as the bank quantiser
    w_even = torch.cat([w, w[:, :1]], dim=1)  # 8 rows, so the bank can pack two columns per byte
    ref = dequantize_mxfp4(*quantize_mxfp4(w_even.transpose(1, 2).contiguous()))[..., :7]
    assert torch.equal(got, ref)
    assert float((got - w.transpose(1, 2)).abs().max()) < 2 * float(w.abs().max()) / 4
    # and back into the bank layout without loss
    blocks8, scales8 = to_gpt_oss_blocks(w_even)
    want = convert(blocks8, scales8, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(*from_gpt_oss_blocks(blocks8, scales8)), want)


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="float32"):
        quantize_mxfp4(torch.randn(32, 4, dtype=torch.float64))
    for bad in (float("nan"), float("-inf")):
        w = torch.randn(32, 4)
        w[1, 1] = bad
        with pytest.raises(ValueError, match="inf or NaN"):
            quantize_mxfp4(w)
    with pytest.raises(ValueError, match="multiple of"):
        quantize_mxfp4(torch.randn(48, 4))
    with pytest.raises(ValueError, match="even"):
        quantize_mxfp4(torch.randn(32, 3))
    with pytest.raises(ValueError, match="multiple of"):
        to_gpt_oss_blocks(torch.randn(2, 4, 40))
    fp4, e8m0 = quantize_mxfp4(torch.randn(64, 4))
    with pytest.raises(ValueError, match="shape"):
        dequantize_mxfp4(fp4, e8m0[:1])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(fp4.to(torch.int8), e8m0)
    blocks, scales = to_gpt_oss_blocks(torch.randn(1, 4, 64))
    with pytest.raises(ValueError, match="shape"):
        from_gpt_oss_blocks(blocks, scales[..., :1])
    with pytest.raises(ValueError, match=r"\[\.\.\., rows, K/32, 16\]"):
        from_gpt_oss_blocks(blocks[..., :8], scales)
    with pytest.raises(ValueError, match="NaN"):
        from_gpt_oss_blocks(blocks, torch.full_like(scales, 255))
    with pytest.raises(ValueError, match="even"):
        from_gpt_oss_blocks(*to_gpt_oss_blocks(torch.randn(1, 3, 32)))
