"""Run one expert whose weights sit in device cache slots.

Emulated device: slots are host memory, and the same CPU kernel runs on the slot's copy of the
bytes, so results are bit-identical to the CPU branch. CUDA: torch matmuls on the slot tensors
(fp32 / bf16; q8 / mxfp4 dequantised to float32 on the device first) or the int4 RawKernel from native/.
"""

from __future__ import annotations

import torch

from moed.cache.host_bank import ExpertBank
from moed.experts.expert_ffn import apply_activation, run_expert


def run_slot_expert(slot_bank: ExpertBank, slot: int, x: torch.Tensor, *, on_cuda: bool) -> torch.Tensor:
    """x [T, D] (on the slot's device) -> [T, D]."""
    if not on_cuda:
        return run_expert(slot_bank, slot, x)
    t = slot_bank.tensors
    gate_up = _matmul(t, "gate_up", slot, x, slot_bank.dtype)  # [T, 2I]
    if "gate_up_bias" in t:
        gate_up = gate_up + t["gate_up_bias"][slot]
    hidden = apply_activation(gate_up, slot_bank.activation)
    out = _matmul(t, "down", slot, hidden, slot_bank.dtype)
    if "down_bias" in t:
        out = out + t["down_bias"][slot]
    return out


def _matmul(t: dict[str, torch.Tensor], name: str, slot: int, x: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "int4":
        from moed.devices.cuda_kernels import int4_matmul

        return int4_matmul(x, t[f"{name}.q"][slot], t[f"{name}.scale"][slot], t[f"{name}.min"][slot])
    from moed.devices.cuda_kernels import slot_matrix_f32

    return x @ slot_matrix_f32(t, name, slot)  # fp32 / bf16 widened; q8 / mxfp4 dequantised on the device
