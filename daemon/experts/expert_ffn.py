"""One routed expert's FFN on the CPU: gate_up matmul, gated activation, down matmul (plus optional biases)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moed.cache.host_bank import ExpertActivation, ExpertBank
from moed.kernels.expert_matmul import expert_matmul, expert_matmul_reference

_Matmul = Callable[[dict[str, torch.Tensor], str, int, torch.Tensor], torch.Tensor]


def apply_activation(gate_up: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate columns first, then up) -> ``[T, I]``."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if act.kind == "silu":
        return F.silu(gate) * up
    # gpt_oss: clamped SwiGLU with a sigmoid gate and an up that is shifted by one.
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    glu = gate * torch.sigmoid(gate * act.alpha)
    return (up + 1.0) * glu


def _run(bank: ExpertBank, flat_id: int, x: torch.Tensor, matmul: _Matmul) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != bank.hidden_size:
        raise ValueError(f"x must be [T, {bank.hidden_size}], got {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if not 0 <= flat_id < bank.num_slots:
        raise ValueError(f"flat_id {flat_id} out of range (bank has {bank.num_slots} experts)")
    x = x.contiguous()
    h = matmul(bank.tensors, "gate_up", flat_id, x)  # [T, 2I]
    if bank.has_bias:
        h += bank.tensors["gate_up_bias"][flat_id]
    a = apply_activation(h, bank.activation).contiguous()  # [T, I]
    y = matmul(bank.tensors, "down", flat_id, a)  # [T, D]
    if "down_bias" in bank.tensors:
        y += bank.tensors["down_bias"][flat_id]
    return y


def run_expert(bank: ExpertBank, flat_id: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``flat_id`` applied to ``x [T, D]`` float32 -> ``[T, D]`` float32, with the numba kernels."""
    return _run(bank, flat_id, x, expert_matmul)


def run_expert_reference(bank: ExpertBank, flat_id: int, x: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of ``run_expert`` (dequantize, then ``torch.matmul``)."""
    return _run(bank, flat_id, x, expert_matmul_reference)
