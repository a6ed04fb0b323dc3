"""build_expert_bank: layout, conversion per dtype, validation."""

from __future__ import annotations

import pytest
import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.kernels.int4_format import dequantize_int4

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


def test_int4_needs_multiples_of_the_group() -> None:
    gate_up, down = torch.randn(1, 48, 64), torch.randn(1, 32, 48)
    with pytest.raises(ValueError, match="hidden size"):
        build_expert_bank(gate_up, down, num_moe_layers=1, num_experts=1, dtype="int4", activation=ACT)
    build_expert_bank(gate_up, down, num_moe_layers=1, num_experts=1, dtype="bf16", activation=ACT)
