"""Run a group of experts whose weights sit in device cache slots: one grouped computation per matrix.

The rows of ``x`` are grouped by expert (rows ``offsets[e]:offsets[e+1]`` go to slot
``slot_ids[e]``); gate_up, the activation and down each run once for the whole group through
the device's ``grouped_matmul`` (CUDA: the int4 kernel over many slots, torch matmuls for
fp32 / bf16 / q8 / mxfp4; the emulated device: the same torch code on CPU tensors). Nothing
here reads a device tensor back to the host, so it can be queued on a stream.
"""

from __future__ import annotations

from typing import Sequence

import torch

from moed.cache.host_bank import ExpertBank
from moed.experts.expert_ffn import apply_activation


def run_grouped_experts(device, slot_bank: ExpertBank, x: torch.Tensor, slot_ids: Sequence[int],
                        offsets: Sequence[int]) -> torch.Tensor:
    """``x [T, D]`` float32 on the device, grouped by expert -> ``[T, D]`` float32 on the device."""
    t = slot_bank.tensors
    row_slot = None
    if "gate_up_bias" in t or "down_bias" in t:
        counts = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], dtype=torch.long)
        row_slot = device.to_device(torch.repeat_interleave(torch.tensor(list(slot_ids), dtype=torch.long), counts))
    gate_up = device.grouped_matmul(x, t, "gate_up", slot_ids, offsets)  # [T, 2I]
    if "gate_up_bias" in t:
        gate_up = gate_up + t["gate_up_bias"].index_select(0, row_slot).float()
    hidden = apply_activation(gate_up, slot_bank.activation)  # [T, I]
    out = device.grouped_matmul(hidden.contiguous(), t, "down", slot_ids, offsets)  # [T, D]
    if "down_bias" in t:
        out = out + t["down_bias"].index_select(0, row_slot).float()
    return out
