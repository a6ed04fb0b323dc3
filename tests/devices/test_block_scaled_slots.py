"""grouped_matmul / slot_matrix_f32 on q8 and mxfp4 slots (CPU tensors: the same torch code runs on CUDA)."""

from __future__ import annotations

import pytest
import torch

from moed.devices import cuda_kernels as ck
from moed.kernels.mxfp4_format import MXFP4_GROUP_SIZE, dequantize_mxfp4, quantize_mxfp4
from moed.kernels.q8_format import Q8_GROUP_SIZE, dequantize_q8, quantize_q8

from helpers import int4_oracle as oracle  # float64 products and the float32 bound, never the code under test

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitudes of codes 0..7, from the OCP MX definition


def _q8_f64(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``w = qs * d`` per group of 32 rows, float64, restated from the format."""
    *lead, k, n = qs.shape
    w = qs.double().reshape(*lead, k // 32, 32, n) * d.double().unsqueeze(-2)
    return w.reshape(*lead, k, n)


def _mxfp4_f64(fp4: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """``w = e2m1(code) * 2**(e - 127)``, float64, with integer arithmetic for the nibbles."""
    b = fp4.to(torch.int64)
    codes = torch.cat([torch.remainder(b, 16), torch.div(b, 16, rounding_mode="floor")], dim=-1)  # [..., K, N]
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    v = table[codes]
    *lead, k, n = v.shape
    scale = torch.pow(2.0, e8m0.double() - 127).unsqueeze(-2)  # [..., K/32, 1, N]
    return (v.reshape(*lead, k // 32, 32, n) * scale).reshape(*lead, k, n)


def _slots(fmt: str, num_slots: int, k: int, n: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-4, 5, (num_slots, k // 32, 1, n), generator=gen).float())  # per-group scales
    w = (torch.randn(num_slots, k // 32, 32, n, generator=gen) * spread).reshape(num_slots, k, n)
    if fmt == "q8":
        qs, d = quantize_q8(w)
        return {"down.qs": qs, "down.d": d}, _q8_f64(qs, d)
    fp4, e8m0 = quantize_mxfp4(w)
    return {"down.fp4": fp4, "down.e8m0": e8m0}, _mxfp4_f64(fp4, e8m0)


def test_group_sizes_match_the_bank_formats() -> None:
    assert ck.BLOCK_GROUP_SIZE == Q8_GROUP_SIZE == MXFP4_GROUP_SIZE


@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
def test_slot_dequantisation_matches_the_bank_formats_exactly(fmt: str) -> None:
    slots, w64 = _slots(fmt, 3, 96, 34, seed=1)
    for s in range(3):
        got = ck.slot_matrix_f32(slots, "down", s)
        assert got.dtype == torch.float32 and tuple(got.shape) == (96, 34)
        assert torch.equal(got.double(), w64[s])  # every weight is exact in float32
        bank = dequantize_q8(slots["down.qs"][s], slots["down.d"][s]) if fmt == "q8" else \
            dequantize_mxfp4(slots["down.fp4"][s], slots["down.e8m0"][s])
        assert torch.equal(got, bank)


def test_mxfp4_slot_decodes_every_code_and_the_extreme_scales() -> None:
    fp4 = torch.arange(256).reshape(64, 4).to(torch.uint8)  # every byte: all code pairs (low, high)
    e8m0 = torch.tensor([[0, 1, 127, 200, 30, 254, 128, 126], [127] * 8], dtype=torch.uint8)  # [2, 8]
    e8m0[0, 5] = 130  # keep 6 * 2**127 (inf) out: finite weights only
    got = ck.dequantize_mxfp4_slot(fp4, e8m0)
    assert torch.equal(got.double(), _mxfp4_f64(fp4, e8m0))


@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
@pytest.mark.parametrize("k,n", [(32, 2), (64, 48), (160, 34)])
def test_grouped_matmul_matches_a_float64_oracle(fmt: str, k: int, n: int) -> None:
    slots, w64 = _slots(fmt, 3, k, n, seed=k + n)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, k, generator=gen)
    slot_ids, offsets = [2, 0, 2, 1], [0, 3, 3, 8, 9]  # an expert with no tokens, a slot used twice
    y = ck.grouped_matmul(x, slots, "down", slot_ids, offsets)
    assert y.shape == (9, n) and y.dtype == torch.float32
    oracle.assert_within(y, oracle.grouped_f64(x, w64, slot_ids, offsets),
                         oracle.fp32_bound(x, w64.abs(), slot_ids, offsets), f"{fmt} slots")
    # int32 device-side indices take the same path
    y_t = ck.grouped_matmul(x, slots, "down", torch.tensor(slot_ids, dtype=torch.int32),
                            torch.tensor(offsets, dtype=torch.int32))
    assert torch.equal(y_t, y)


@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
def test_grouped_matmul_uses_each_groups_scale(fmt: str) -> None:
    slots, w64 = _slots(fmt, 1, 128, 16, seed=5)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(6))
    key = "down.d" if fmt == "q8" else "down.e8m0"
    flat = dict(slots, **{key: slots[key][:, :1].expand_as(slots[key]).contiguous()})
    good = ck.grouped_matmul(x, slots, "down", [0], [0, 2])
    bad = ck.grouped_matmul(x, flat, "down", [0], [0, 2])
    bound = oracle.fp32_bound(x, w64.abs(), [0], [0, 2])
    oracle.assert_within(good, oracle.grouped_f64(x, w64, [0], [0, 2]), bound, fmt)
    assert float(((bad.double() - oracle.grouped_f64(x, w64, [0], [0, 2])).abs() > 100 * bound).float().mean()) > 0.9


def test_block_scaled_slots_are_checked() -> None:
    q8, _ = _slots("q8", 2, 64, 8, seed=0)
    mx, _ = _slots("mxfp4", 2, 64, 8, seed=0)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"down\.d"):
        ck.grouped_matmul(x, {"down.qs": q8["down.qs"]}, "down", [0], [0, 3])
    with pytest.raises(ValueError, match="float16"):
        ck.grouped_matmul(x, dict(q8, **{"down.d": q8["down.d"].float()}), "down", [0], [0, 3])
    with pytest.raises(ValueError, match=r"down\.e8m0"):
        ck.grouped_matmul(x, dict(mx, **{"down.e8m0": mx["down.e8m0"][:, :1]}), "down", [0], [0, 3])
    with pytest.raises(ValueError, match="uint8"):
        ck.grouped_matmul(x, dict(mx, **{"down.fp4": mx["down.fp4"].to(torch.int8)}), "down", [0], [0, 3])
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        ck.grouped_matmul(torch.randn(3, 32), q8, "down", [0], [0, 3])
    with pytest.raises(ValueError, match="out of range"):
        ck.grouped_matmul(x, mx, "down", [2], [0, 3])
    with pytest.raises(ValueError, match="rise from 0"):
        ck.grouped_matmul(x, q8, "down", [0, 1], [0, 2, 1])
    with pytest.raises(ValueError, match="no matrix"):
        ck.slot_matrix_f32(q8, "gate_up", 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
def test_grouped_matmul_on_cuda_matches_a_float64_oracle(fmt: str) -> None:
    slots, w64 = _slots(fmt, 4, 512, 256, seed=8)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(9))
    slot_ids, offsets = [3, 1, 3, 0], [0, 4, 4, 10, 11]
    y = ck.grouped_matmul(x.cuda(), {k: v.cuda() for k, v in slots.items()}, "down", slot_ids, offsets)
    assert y.is_cuda and y.dtype == torch.float32
    oracle.assert_within(y, oracle.grouped_f64(x, w64, slot_ids, offsets),
                         oracle.fp32_bound(x, w64.abs(), slot_ids, offsets), f"{fmt} slots on CUDA")
