"""build_expert_bank: layout, conversion per dtype, validation."""

from __future__ import annotations

import pytest
import torch

from moed.cache.bank_builder import bank_tensor_specs, build_expert_bank, convert_expert_rows, dequantize_bank_rows
from moed.cache.host_bank import EXPERT_DTYPES, ExpertActivation
from moed.kernels.int4_format import dequantize_int4
from moed.kernels.mxfp4_format import dequantize_mxfp4
from moed.kernels.q8_format import dequantize_q8

D, I = 64, 32
ACT = ExpertActivation("silu")


def _weights(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, D, 2 * I, generator=gen), torch.randn(n, I, D, generator=gen)


def _build(dtype: str, **kw: object) -> object:
    gate_up, down = _weights()
    return build_expert_bank(gate_up, down, num_moe_layers=2, num_experts=2, dtype=dtype, activation=ACT, **kw)


def test_fp32_and_bf16_layout() -> None:
    gate_up, down = _weights()
    for dtype, tdtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        bank = build_expert_bank(gate_up, down, num_moe_layers=2, num_experts=2, dtype=dtype, activation=ACT)
        assert set(bank.tensors) == {"gate_up", "down"}
        assert bank.tensors["gate_up"].dtype == tdtype and tuple(bank.tensors["gate_up"].shape) == (4, D, 2 * I)
        assert bank.tensors["down"].dtype == tdtype and tuple(bank.tensors["down"].shape) == (4, I, D)
        assert all(t.is_contiguous() for t in bank.tensors.values())
        assert torch.equal(bank.tensors["down"], down.to(tdtype))
        assert (bank.hidden_size, bank.intermediate_size, bank.num_slots, bank.dtype) == (D, I, 4, dtype)


def test_int4_layout_and_accuracy() -> None:
    gate_up, down = _weights()
    bank = build_expert_bank(gate_up, down, num_moe_layers=2, num_experts=2, dtype="int4", activation=ACT)
    t = bank.tensors
    assert set(t) == {f"{m}.{p}" for m in ("gate_up", "down") for p in ("q", "scale", "min")}
    assert t["gate_up.q"].dtype == torch.uint8 and tuple(t["gate_up.q"].shape) == (4, D, I)
    assert tuple(t["gate_up.scale"].shape) == (4, D // 32, 2 * I) and t["gate_up.min"].dtype == torch.bfloat16
    assert tuple(t["down.q"].shape) == (4, I, D // 2) and tuple(t["down.scale"].shape) == (4, I // 32, D)
    assert all(v.is_contiguous() for v in t.values())
    err = (dequantize_int4(t["down.q"], t["down.scale"], t["down.min"]) - down).abs()
    step = t["down.scale"].float().repeat_interleave(32, dim=1)
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-7).all())
    # 4 bits per weight plus two bf16 per 32 weights
    assert bank.bytes_per_expert() == (D * 2 * I + I * D) // 2 + 2 * 2 * (D // 32 * 2 * I + I // 32 * D)


def test_biases_are_kept_as_float32() -> None:
    n = 4
    bank = _build("bf16", gate_up_bias=torch.randn(n, 2 * I), down_bias=torch.randn(n, D))
    assert bank.has_bias
    assert bank.tensors["gate_up_bias"].dtype == torch.float32 and tuple(bank.tensors["down_bias"].shape) == (n, D)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(dtype="int8"), "not one of"),
        (dict(num_experts=3), "shape"),
        (dict(gate_up=torch.randn(4, D, 2 * I + 1)), "even"),
        (dict(down=torch.randn(4, I + 1, D)), "shape"),
        (dict(gate_up=torch.randn(4, D, 2 * I, dtype=torch.float64)), "float32"),
        (dict(gate_up=torch.randn(D, 2 * I)), "gate_up must be"),
        (dict(gate_up_bias=torch.randn(4, 2 * I)), "both"),
        (dict(gate_up_bias=torch.randn(4, 2 * I), down_bias=torch.randn(4, D + 1)), "down_bias"),
        (dict(num_moe_layers=0), ">= 1"),
    ],
)
def test_bad_inputs_raise(change: dict, match: str) -> None:
    gate_up, down = _weights()
    kw: dict = dict(gate_up=gate_up, down=down, num_moe_layers=2, num_experts=2, dtype="fp32", activation=ACT)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        build_expert_bank(kw.pop("gate_up"), kw.pop("down"), **kw)


@pytest.mark.parametrize("dtype", ["int4", "q8", "mxfp4"])
def test_packed_dtypes_need_multiples_of_the_group(dtype: str) -> None:
    gate_up, down = torch.randn(1, 48, 64), torch.randn(1, 32, 48)
    with pytest.raises(ValueError, match="hidden size"):
        build_expert_bank(gate_up, down, num_moe_layers=1, num_experts=1, dtype=dtype, activation=ACT)
    gate_up, down = torch.randn(1, 64, 96), torch.randn(1, 48, 64)
    with pytest.raises(ValueError, match="intermediate size"):
        build_expert_bank(gate_up, down, num_moe_layers=1, num_experts=1, dtype=dtype, activation=ACT)
    build_expert_bank(gate_up, down, num_moe_layers=1, num_experts=1, dtype="bf16", activation=ACT)


def test_q8_layout_and_accuracy() -> None:
    gate_up, down = _weights()
    bank = build_expert_bank(gate_up, down, num_moe_layers=2, num_experts=2, dtype="q8", activation=ACT)
    t = bank.tensors
    assert set(t) == {f"{m}.{p}" for m in ("gate_up", "down") for p in ("qs", "d")}
    assert t["gate_up.qs"].dtype == torch.int8 and tuple(t["gate_up.qs"].shape) == (4, D, 2 * I)
    assert t["gate_up.d"].dtype == torch.float16 and tuple(t["gate_up.d"].shape) == (4, D // 32, 2 * I)
    assert tuple(t["down.qs"].shape) == (4, I, D) and tuple(t["down.d"].shape) == (4, I // 32, D)
    err = (dequantize_q8(t["down.qs"], t["down.d"]) - down).abs()
    assert bool((err <= t["down.d"].float().repeat_interleave(32, dim=1) / 2 * (1 + 1e-6)).all())
    # one byte per weight plus one fp16 per 32 weights
    assert bank.bytes_per_expert() == (D * 2 * I + I * D) + 2 * (D // 32 * 2 * I + I // 32 * D)


def test_mxfp4_layout_and_accuracy() -> None:
    gate_up, down = _weights()
    bank = build_expert_bank(gate_up, down, num_moe_layers=2, num_experts=2, dtype="mxfp4", activation=ACT)
    t = bank.tensors
    assert set(t) == {f"{m}.{p}" for m in ("gate_up", "down") for p in ("fp4", "e8m0")}
    assert t["gate_up.fp4"].dtype == torch.uint8 and tuple(t["gate_up.fp4"].shape) == (4, D, I)
    assert t["gate_up.e8m0"].dtype == torch.uint8 and tuple(t["gate_up.e8m0"].shape) == (4, D // 32, 2 * I)
    assert tuple(t["down.fp4"].shape) == (4, I, D // 2) and tuple(t["down.e8m0"].shape) == (4, I // 32, D)
    deq = dequantize_mxfp4(t["down.fp4"], t["down.e8m0"])
    scale = torch.exp2(t["down.e8m0"].float() - 127).repeat_interleave(32, dim=1)
    assert bool(((deq - down).abs() <= 2 * scale).all())  # the largest of a group may be clamped 8 -> 6
    # 4 bits per weight plus one byte per 32 weights
    assert bank.bytes_per_expert() == (D * 2 * I + I * D) // 2 + (D // 32 * 2 * I + I // 32 * D)


@pytest.mark.parametrize("dtype", EXPERT_DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_specs_and_row_conversion_agree_with_the_bank(dtype: str, has_bias: bool) -> None:
    gate_up, down = _weights()
    biases = dict(gate_up_bias=torch.randn(4, 2 * I), down_bias=torch.randn(4, D)) if has_bias else {}
    bank = _build(dtype, **biases)
    specs = bank_tensor_specs(dtype, 4, D, I, has_bias)
    assert specs == {k: (tuple(v.shape), v.dtype) for k, v in bank.tensors.items()}
    # rows converted a few at a time are exactly the rows of the whole bank
    part = convert_expert_rows(gate_up[1:3], down[1:3], dtype, *(b[1:3] for b in biases.values()))
    assert set(part) == set(bank.tensors)
    assert all(torch.equal(part[k], bank.tensors[k][1:3]) for k in part)


@pytest.mark.parametrize("dtype", EXPERT_DTYPES)
def test_dequantize_bank_rows_matches_the_format_reference(dtype: str) -> None:
    gate_up, down = _weights()
    bank = _build(dtype)
    deq_gu, deq_dn = dequantize_bank_rows(bank.tensors, dtype)
    assert deq_gu.shape == gate_up.shape and deq_dn.shape == down.shape and deq_dn.dtype == torch.float32
    # converting the dequantised rows back gives the same bank rows: every format is a fixed point
    again = convert_expert_rows(deq_gu, deq_dn, dtype)
    assert all(torch.equal(again[k], bank.tensors[k]) for k in again), dtype
    assert float((deq_dn - down).abs().max()) < 2.0  # the right rows, roughly (exactness is each format's test)
