"""Builds an ExpertBank in the chosen storage dtype from float32 k-major expert weights."""

from __future__ import annotations

import torch

from moed.cache.host_bank import EXPERT_DTYPES, INT4_GROUP_SIZE, ExpertActivation, ExpertBank
from moed.kernels.int4_format import quantize_int4


def _check_f32(t: torch.Tensor, what: str, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"{what} must be float32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} must have shape {shape}, got {tuple(t.shape)}")


def _convert(name: str, w: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """One matrix kind ``w [N, K, Ncols]`` float32 in bank layout."""
    if dtype == "fp32":
        return {name: w.contiguous()}
    if dtype == "bf16":
        return {name: w.to(torch.bfloat16).contiguous()}
    q, scale, mn = quantize_int4(w)
    return {f"{name}.q": q, f"{name}.scale": scale, f"{name}.min": mn}


def build_expert_bank(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    num_moe_layers: int,
    num_experts: int,
    dtype: str,
    activation: ExpertActivation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> ExpertBank:
    """``gate_up [N, D, 2I]`` and ``down [N, I, D]`` float32, k-major (gate columns before up), ``N = layers * experts``."""
    if dtype not in EXPERT_DTYPES:
        raise ValueError(f"bank dtype {dtype!r} is not one of {EXPERT_DTYPES}")
    if num_moe_layers < 1 or num_experts < 1:
        raise ValueError(f"need num_moe_layers >= 1 and num_experts >= 1, got {num_moe_layers}, {num_experts}")
    if gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"gate_up must be [N, D, 2I] and down [N, I, D], got {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    slots = num_moe_layers * num_experts
    _, hidden, two_inter = gate_up.shape
    if two_inter % 2:
        raise ValueError(f"gate_up's last dimension (2I) must be even, got {two_inter}")
    inter = two_inter // 2
    _check_f32(gate_up, "gate_up", (slots, hidden, two_inter))
    _check_f32(down, "down", (slots, inter, hidden))
    if dtype == "int4":
        for what, k in (("hidden size D", hidden), ("intermediate size I", inter)):
            if k % INT4_GROUP_SIZE:
                raise ValueError(f"int4 bank: {what}={k} must be a multiple of {INT4_GROUP_SIZE}")
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("give both gate_up_bias and down_bias, or neither")

    tensors = {**_convert("gate_up", gate_up, dtype), **_convert("down", down, dtype)}
    if gate_up_bias is not None and down_bias is not None:
        _check_f32(gate_up_bias, "gate_up_bias", (slots, two_inter))
        _check_f32(down_bias, "down_bias", (slots, hidden))
        tensors["gate_up_bias"] = gate_up_bias.contiguous()
        tensors["down_bias"] = down_bias.contiguous()
    return ExpertBank(
        num_moe_layers=num_moe_layers,
        num_experts=num_experts,
        hidden_size=hidden,
        intermediate_size=inter,
        dtype=dtype,
        activation=activation,
        tensors=tensors,
    )
