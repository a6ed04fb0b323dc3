"""quantize_q8 / dequantize_q8: layout, error bound, fp16 scales, GGUF Q8_0 blocks, edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moed.kernels.q8_format import Q8_GROUP_SIZE, dequantize_q8, quantize_q8


def test_shapes_and_dtypes() -> None:
    qs, d = quantize_q8(torch.randn(3, 64, 10))
    assert qs.dtype == torch.int8 and tuple(qs.shape) == (3, 64, 10)
    assert d.dtype == torch.float16 and tuple(d.shape) == (3, 2, 10)
    assert qs.is_contiguous() and d.is_contiguous()


@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1.0, 300.0, 5e4])
def test_error_at_most_half_a_step(magnitude: float) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2, 96, 34, generator=gen) * torch.rand(2, 96, 34, generator=gen) * magnitude
    qs, d = quantize_q8(w)
    assert int(qs.abs().max()) <= 127
    step = d.float().repeat_interleave(Q8_GROUP_SIZE, dim=-2)
    err = (dequantize_q8(qs, d) - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all())
    # d is no bigger than needed: amax / 127 up to fp16 rounding (one ulp up at most)
    amax = w.reshape(2, 3, 32, 34).abs().amax(2)
    assert bool((d.float() * 127 >= amax).all())
    assert bool((d.float() * 127 <= amax * (1 + 2 * 2**-10) + 127 * 2**-24).all())


def test_largest_weight_of_a_group_is_plus_or_minus_127() -> None:
    w = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    qs, _ = quantize_q8(w)
    g_q = qs.reshape(2, 32, 8).abs().amax(1)
    assert bool((g_q >= 126).all())  # 127 unless fp16 rounding made d one ulp larger


def test_scale_rounding_is_stepped_up_when_fp16_rounds_down() -> None:
    # amax / 127 for amax = 1 rounds down in fp16 (1/127 = 0x1C08.4...), so d must be stepped up
    w = torch.zeros(32, 1)
    w[5, 0] = -1.0
    qs, d = quantize_q8(w)
    assert float(d) * 127 >= 1.0 and float(torch.tensor(1 / 127).half()) * 127 < 1.0
    assert int(qs[5, 0]) == -127 and int(qs.abs().sum()) == 127


def test_zero_group_and_tiny_weights() -> None:
    w = torch.zeros(64, 3)
    w[40:, 1] = 1e-9  # below fp16's subnormal range / 127: d becomes its smallest step
    qs, d = quantize_q8(w)
    assert float(d[0].abs().max()) == 0.0 and int(qs[:32].abs().max()) == 0
    assert float(d[1, 0]) == 0.0 and float(d[1, 1]) > 0.0
    assert bool(((dequantize_q8(qs, d) - w).abs() <= d.float().repeat_interleave(32, 0) / 2).all())


def test_gguf_q8_0_blocks_repack_without_loss() -> None:
    """A GGUF Q8_0 block (fp16 d, then 32 int8 along K, per output row) is one (d, qs) column segment."""
    rng = np.random.default_rng(0)
    rows, k = 6, 64
    d = rng.standard_normal((rows, k // 32)).astype(np.float16)  # [rows, K/32]
    q = rng.integers(-128, 128, size=(rows, k // 32, 32), dtype=np.int8)  # [rows, K/32, 32]
    want = torch.from_numpy(q.astype(np.float32) * d.astype(np.float32)[..., None]).reshape(rows, k)  # [rows, K]
    qs = torch.from_numpy(q.reshape(rows, k)).t().contiguous()  # [K, rows]
    dd = torch.from_numpy(d).t().contiguous()  # [K/32, rows]
    assert torch.equal(dequantize_q8(qs, dd), want.t())


def test_dequantize_applies_each_groups_scale() -> None:
    qs = torch.ones(64, 2, dtype=torch.int8)
    d = torch.tensor([[1.0, 2.0], [0.5, -4.0]], dtype=torch.float16)
    w = dequantize_q8(qs, d)
    assert torch.equal(w[:32], torch.tensor([[1.0, 2.0]]).expand(32, 2))
    assert torch.equal(w[32:], torch.tensor([[0.5, -4.0]]).expand(32, 2))


@pytest.mark.parametrize("shape", [(31, 4), (48, 3), (8,)])
def test_bad_shapes_raise(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        quantize_q8(torch.randn(*shape))


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="float32"):
        quantize_q8(torch.randn(32, 4, dtype=torch.float64))
    for bad in (float("nan"), float("inf")):
        w = torch.randn(32, 4)
        w[3, 1] = bad
        with pytest.raises(ValueError, match="inf or NaN"):
            quantize_q8(w)
    with pytest.raises(ValueError, match="fp16"):
        quantize_q8(torch.full((32, 4), 1e7))
    qs, d = quantize_q8(torch.randn(64, 4))
    with pytest.raises(ValueError, match="shape"):
        dequantize_q8(qs, d[:1])
    with pytest.raises(ValueError, match="float16"):
        dequantize_q8(qs, d.to(torch.bfloat16))
    with pytest.raises(ValueError, match="int8"):
        dequantize_q8(qs.to(torch.uint8), d)
    with pytest.raises(ValueError, match="multiple of"):
        dequantize_q8(torch.zeros(48, 4, dtype=torch.int8), torch.zeros(1, 4, dtype=torch.float16))
