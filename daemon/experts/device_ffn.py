"""Run a group of experts whose weights sit in device cache slots: one grouped computation per matrix.

The rows of ``x`` are grouped by expert (rows ``offsets[e]:offsets[e+1]`` go to slot
``slot_ids[e]``); gate_up, the activation and down each run once for the whole group through
the device's ``grouped_matmul`` (CUDA: the int4 kernel over many slots, torch matmuls for
fp32 / bf16 / q8 / mxfp4; the emulated device: the same torch code on CPU tensors); a ggml bank's
slots hold one layer's GGUF block rows per call, decoded on the device (experts/ggml_slots.py).
Nothing here reads a device tensor back to the host, so it can be queued on a stream.
"""

from __future__ import annotations

from typing import Sequence

import torch

from moed.cache.host_bank import GGML_BANK, ExpertBank
from moed.devices.device import slot_layout as mirrored_layout
from moed.experts import ggml_slots
from moed.experts.expert_ffn import apply_activation


def slot_layout_of(bank: ExpertBank) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The device slots ``bank``'s experts need: one row of every bank tensor, or a ggml bank's widest rows."""
    if bank.dtype == GGML_BANK:
        return ggml_slots.slot_layout(bank)
    return mirrored_layout(bank.tensors)


def copy_experts(device, slots: dict[str, torch.Tensor], dst_slots: Sequence[int], bank: ExpertBank,
                 flat_ids: Sequence[int]) -> list:
    """Queue the copies of ``bank``'s experts ``flat_ids`` into ``dst_slots``: one copy, or for a ggml bank one
    per layer among them (each layer's rows in its own types and sizes). Their handles."""
    if bank.dtype != GGML_BANK:
        return [device.copy_rows_async(slots, list(dst_slots), bank.tensors, list(flat_ids))]
    handles = []
    for layer, dst, rows in ggml_slots.copies_by_layer(bank, dst_slots, flat_ids):
        src = ggml_slots.layer_source(bank, layer)
        handles.append(device.copy_rows_async({k: slots[k] for k in src}, dst, src, rows))
    return handles


def run_grouped_experts(device, slot_bank: ExpertBank, x: torch.Tensor, slot_ids: Sequence[int],
                        offsets: Sequence[int],
                        matrices: dict[str, ggml_slots.SlotMatrix] | None = None) -> torch.Tensor:
    """``x [T, D]`` float32 on the device, grouped by expert -> ``[T, D]`` float32 on the device.

    ``matrices``: a ggml bank's layer (the types and shapes of its gate, up and down in the slots)."""
    t = slot_bank.tensors
    row_slot = None
    if "gate_up_bias" in t or "down_bias" in t:
        counts = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], dtype=torch.long)
        row_slot = device.to_device(torch.repeat_interleave(torch.tensor(list(slot_ids), dtype=torch.long), counts))
    if slot_bank.dtype == GGML_BANK and matrices is None:
        raise ValueError("ggml slots hold any layer's rows: pass the layer's matrices")

    def matmul(h: torch.Tensor, name: str) -> torch.Tensor:
        if matrices is None:
            return device.grouped_matmul(h, t, name, slot_ids, offsets)
        if getattr(device, "timing_only", False):  # schedule benchmarks: shapes only, as grouped_matmul does
            width = 2 * matrices["up"].rows if name == "gate_up" else matrices["down"].rows
            return torch.zeros((h.shape[0], width), dtype=torch.float32, device=h.device)
        if name == "down":
            return ggml_slots.grouped_matmul(h, t, "down", matrices["down"], slot_ids, offsets)
        up = ggml_slots.grouped_matmul(h, t, "up", matrices["up"], slot_ids, offsets)
        gate = ggml_slots.grouped_matmul(h, t, "gate", matrices["gate"], slot_ids, offsets) if "gate" in matrices else up
        return torch.cat([gate, up], dim=1)  # a layer whose gate is its up (relu^2) multiplies it once

    gate_up = matmul(x, "gate_up")  # [T, 2I]
    if "gate_up_bias" in t:
        gate_up = gate_up + t["gate_up_bias"].index_select(0, row_slot).float()
    hidden = apply_activation(gate_up, slot_bank.activation)  # [T, I]
    out = matmul(hidden.contiguous(), "down")  # [T, D]
    if "down_bias" in t:
        out = out + t["down_bias"].index_select(0, row_slot).float()
    return out
