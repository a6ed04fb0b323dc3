"""Builds an ExpertBank in the chosen storage dtype from float32 k-major expert weights."""

from __future__ import annotations

import torch

from moed.cache.host_bank import EXPERT_DTYPES, INT4_GROUP_SIZE, PACKED_DTYPES, ExpertActivation, ExpertBank
from moed.kernels.int4_format import dequantize_int4, quantize_int4
from moed.kernels.mxfp4_format import dequantize_mxfp4, quantize_mxfp4
from moed.kernels.q8_format import dequantize_q8, quantize_q8


def _check_f32(t: torch.Tensor, what: str, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"{what} must be float32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} must have shape {shape}, got {tuple(t.shape)}")


def _convert(name: str, w: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """One matrix kind ``w [N, K, Ncols]`` float32 in bank layout (each of the N rows on its own, so
    converting a few rows at a time gives exactly the rows of converting them all at once)."""
    if dtype == "fp32":
        return {name: w.contiguous()}
    if dtype == "bf16":
        return {name: w.to(torch.bfloat16).contiguous()}
    if dtype == "int4":
        q, scale, mn = quantize_int4(w)
        return {f"{name}.q": q, f"{name}.scale": scale, f"{name}.min": mn}
    if dtype == "q8":
        qs, d = quantize_q8(w)
        return {f"{name}.qs": qs, f"{name}.d": d}
    if dtype == "mxfp4":
        fp4, e8m0 = quantize_mxfp4(w)
        return {f"{name}.fp4": fp4, f"{name}.e8m0": e8m0}
    raise ValueError(f"bank dtype {dtype!r} is not one of {EXPERT_DTYPES}")


def bank_tensor_specs(dtype: str, num_slots: int, hidden: int, inter: int,
                      has_bias: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor of a bank, without building it (what a streaming
    writer reserves before the rows arrive); the same names and shapes build_expert_bank makes."""
    probe = convert_expert_rows(torch.zeros(1, hidden, 2 * inter), torch.zeros(1, inter, hidden), dtype,
                                torch.zeros(1, 2 * inter) if has_bias else None,
                                torch.zeros(1, hidden) if has_bias else None)
    return {name: ((num_slots, *t.shape[1:]), t.dtype) for name, t in probe.items()}


def convert_expert_rows(gate_up: torch.Tensor, down: torch.Tensor, dtype: str,
                        gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Some consecutive bank rows: float32 ``gate_up [n, D, 2I]``, ``down [n, I, D]`` (+ biases) ->
    the bank's tensors for those n rows, in the bank's dtype."""
    tensors = {**_convert("gate_up", gate_up, dtype), **_convert("down", down, dtype)}
    if gate_up_bias is not None and down_bias is not None:
        tensors["gate_up_bias"] = gate_up_bias.contiguous()
        tensors["down_bias"] = down_bias.contiguous()
    return tensors


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
    if dtype in PACKED_DTYPES:
        for what, k in (("hidden size D", hidden), ("intermediate size I", inter)):
            if k % INT4_GROUP_SIZE:
                raise ValueError(f"{dtype} bank: {what}={k} must be a multiple of {INT4_GROUP_SIZE}")
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("give both gate_up_bias and down_bias, or neither")

    if gate_up_bias is not None and down_bias is not None:
        _check_f32(gate_up_bias, "gate_up_bias", (slots, two_inter))
        _check_f32(down_bias, "down_bias", (slots, hidden))
    tensors = convert_expert_rows(gate_up, down, dtype, gate_up_bias, down_bias)
    return ExpertBank(
        num_moe_layers=num_moe_layers,
        num_experts=num_experts,
        hidden_size=hidden,
        intermediate_size=inter,
        dtype=dtype,
        activation=activation,
        tensors=tensors,
    )


def dequantize_bank_rows(tensors: dict[str, torch.Tensor], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a bank in ``dtype`` (biases ignored) -> float32 ``(gate_up [n, D, 2I], down [n, I, D])``,
    the plain-torch dequantisation (what converting a packed source to another bank dtype starts from)."""
    def one(name: str) -> torch.Tensor:
        if dtype in ("fp32", "bf16"):
            return tensors[name].float()
        if dtype == "int4":
            return dequantize_int4(tensors[f"{name}.q"], tensors[f"{name}.scale"], tensors[f"{name}.min"])
        if dtype == "q8":
            return dequantize_q8(tensors[f"{name}.qs"], tensors[f"{name}.d"])
        if dtype == "mxfp4":
            return dequantize_mxfp4(tensors[f"{name}.fp4"], tensors[f"{name}.e8m0"])
        raise ValueError(f"cannot dequantize bank rows of dtype {dtype!r} (one of {EXPERT_DTYPES})")

    return one("gate_up"), one("down")
