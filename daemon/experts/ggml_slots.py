"""A ggml bank's experts in device cache slots: GGUF block rows copied as stored, decoded on the device.

The ggml bank (cache/host_bank.py) keeps each MoE layer's gate, up and down expert tensors in their
own GGML types, so one (layer, expert) is ``gate.{l}[e]``, ``up.{l}[e]`` and ``down.{l}[e]``, and
their sizes differ between layers (a Q4_K_M file's down is Q6_K in some layers, Q4_K in the
others). A device slot holds any layer's expert: per matrix kind one uint8 row as wide as the
widest layer's, a layer's rows filling its start (the devices' prefix copies: devices/device.py
``prefix_kinds``); the layer a slot holds gives the type, and a computation runs one layer, so
the executor passes that layer's ``SlotMatrix`` per kind. Beside them: a float32 factor per slot
and kind where some layer has one (an NVFP4 checkpoint's per-tensor scale; read only for the layers
that have it) and the biases, as the other banks keep them. A layer whose gate is its up matrix
(Nemotron-H's non-gated relu^2 experts, ``ExpertBank.gate_is_up``) copies and multiplies it once.

A grouped computation decodes its slots' rows with the torch decoders the CPU reference uses
(kernels/gguf_quants.py, bit for bit ``gguf.quants``), a chunk of slots in one pass, then
multiplies each expert's token rows in float32: the arithmetic of the other packed slots (q8,
mxfp4, int4's GEMM form); this is what runs on the emulated device, and on CUDA for prefill row
counts. On CUDA at decode row counts one kernel per matrix decodes the rows inside the product
(native/ggml_rows.cu: its decoders are native/ggml_decode.h, the torch decoders' values bit for bit,
tested on the CPU). The kernels were written and compile-checked without a GPU: the first product of
each type on a device is also computed the torch way and compared (one host sync, once); a kernel that
disagrees is not used again in the process, and the log says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import logging

import torch

from moed.cache.host_bank import GGML_BANK, ExpertBank
from moed.kernels.ggml_x8_format import is_x8
from moed.devices import cuda_kernels as ck
from moed.devices.cuda_kernels import GEMM_MIN_ROWS_PER_EXPERT, as_index
from moed.kernels import gguf_quants as q
from moed.kernels.ggml_rows_format import row_bytes

KINDS = ("gate", "up", "down")
BIASES = ("gate_up_bias", "down_bias")  # indexed by flat id in the bank, by slot in the slots
DEQUANT_CHUNK_BYTES = 64 << 20  # float32 decoded matrices of one chunk of slots (the decoders' temporaries: ~3x more)
_CPU_SLICE = q.DEQUANT_SLICE  # on the CPU (emulated device) decode in cache-sized slices, as the loader does
_kernel_checked: dict[tuple[int, int], bool] = {}  # (CUDA device index, GGML type) -> the kernel agreed with torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotMatrix:
    """One layer's matrix of one kind: ``rows`` rows of ``k`` weights in ``ggml_type``; ``scaled``: the
    layer has a factor per expert on this matrix's outputs."""

    ggml_type: int
    rows: int
    k: int
    scaled: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's matrix (the start of its slot row)."""
        return self.rows * row_bytes(self.ggml_type, self.k)


def layer_kinds(bank: ExpertBank, moe_layer: int) -> tuple[str, ...]:
    """The matrices one layer's slots hold: gate, up and down, or up and down where the gate is the up."""
    return KINDS[1:] if bank.gate_is_up(moe_layer) else KINDS


def layer_matrices(bank: ExpertBank, moe_layer: int) -> dict[str, SlotMatrix]:
    """The types and shapes of one MoE layer's gate, up and down (no gate where it is the up matrix)."""
    out = {}
    for kind in layer_kinds(bank, moe_layer):
        t, ggml_type = bank.ggml_matrix(kind, moe_layer)
        k = bank.hidden_size if kind != "down" else bank.intermediate_size
        out[kind] = SlotMatrix(ggml_type, t.shape[1], k, bank.ggml_scale(kind, moe_layer) is not None)
    return out


def slot_layout(bank: ExpertBank) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The slot layout of a ggml bank: per kind a uint8 row of the widest layer's bytes, a float32 factor
    where any layer has one, the biases as stored."""
    if bank.dtype != GGML_BANK:
        raise ValueError(f"a {bank.dtype} bank's slots mirror its tensors; this layout is the ggml bank's")
    interleaved = sorted(name for name, t in bank.row_types.items() if is_x8(t))
    if interleaved:
        raise ValueError(f"ggml bank matrices {', '.join(interleaved[:3])} are interleaved for the CPU kernels "
                         f"(experts/cpu_layout.py); a device's slots read the GGUF rows: load the bank again")
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for kind in KINDS:
        layers = [ml for ml in range(bank.num_moe_layers) if kind in layer_kinds(bank, ml)]
        if not layers:
            continue
        layout[kind] = ((max(bank.ggml_matrix(kind, ml)[0][0].numel() for ml in layers),), torch.uint8)
        if any(bank.ggml_scale(kind, ml) is not None for ml in layers):
            layout[f"{kind}.scale"] = ((), torch.float32)
    for name in BIASES:
        if name in bank.tensors:
            layout[name] = (tuple(bank.tensors[name].shape[1:]), bank.tensors[name].dtype)
    return layout


def layer_source(bank: ExpertBank, moe_layer: int) -> dict[str, torch.Tensor]:
    """What a copy of ``moe_layer``'s experts reads, by kind, row = expert number (views of the bank: its
    pinned memory): the rows of each matrix, the factors the layer has, its slice of the biases."""
    e = bank.num_experts
    src = {}
    for kind in layer_kinds(bank, moe_layer):
        src[kind] = bank.ggml_matrix(kind, moe_layer)[0].view(e, -1)
        scale = bank.ggml_scale(kind, moe_layer)
        if scale is not None:
            src[f"{kind}.scale"] = scale
    for name in BIASES:
        if name in bank.tensors:
            src[name] = bank.tensors[name][moe_layer * e:(moe_layer + 1) * e]
    return src


def copies_by_layer(bank: ExpertBank, slots: Sequence[int], flat_ids: Sequence[int]
                    ) -> list[tuple[int, list[int], list[int]]]:
    """``(moe_layer, slots, expert numbers)`` per layer among ``flat_ids`` (first-seen layer order)."""
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for slot, flat_id in zip(slots, flat_ids):
        layer, expert = divmod(int(flat_id), bank.num_experts)
        dst, rows = groups.setdefault(layer, ([], []))
        dst.append(int(slot))
        rows.append(expert)
    return [(layer, dst, rows) for layer, (dst, rows) in groups.items()]


def decode_slots(store: torch.Tensor, m: SlotMatrix, index: torch.Tensor) -> torch.Tensor:
    """The matrices of the slots ``index`` (int64 on the store's device) -> float32 ``[len(index), rows, k]``."""
    raw = store[:, :m.nbytes].index_select(0, index)  # [c, bytes] contiguous
    slice_weights = _CPU_SLICE if store.device.type == "cpu" else None
    return q.dequantize(raw.reshape(-1), m.ggml_type, (index.shape[0] * m.rows, m.k),
                        slice_weights=slice_weights).view(index.shape[0], m.rows, m.k)


def grouped_matmul(x: torch.Tensor, slots: dict[str, torch.Tensor], kind: str, m: SlotMatrix,
                   slot_ids: Sequence[int], offsets: Sequence[int]) -> torch.Tensor:
    """``x [T, k]`` float32 (rows grouped by expert: ``offsets[e]:offsets[e+1]`` go to slot ``slot_ids[e]``)
    times each slot's ``kind`` matrix -> ``[T, rows]`` float32, the layer's factor applied."""
    store = slots[kind]
    if store.dtype != torch.uint8 or store.dim() != 2 or store.shape[1] < m.nbytes:
        raise ValueError(f"ggml slots {kind!r} must be uint8 [S, >= {m.nbytes}], got {store.dtype} {tuple(store.shape)}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != m.k:
        raise ValueError(f"x must be float32 [T, {m.k}], got {x.dtype} {tuple(x.shape)}")
    ids, offs = [int(s) for s in slot_ids], [int(o) for o in offsets]
    if len(offs) != len(ids) + 1 or offs[0] != 0 or offs[-1] != x.shape[0] or any(a > b for a, b in zip(offs, offs[1:])):
        raise ValueError(f"offsets must rise from 0 to the token count {x.shape[0]} in {len(ids) + 1} steps, got {offs}")
    if any(not 0 <= s < store.shape[0] for s in ids):
        raise ValueError(f"slot ids {ids} out of range (there are {store.shape[0]} slots)")
    scale = slots.get(f"{kind}.scale") if m.scaled else None
    if m.scaled and scale is None:
        raise ValueError(f"the layer scales {kind!r} but the slots hold no {kind}.scale")
    if x.device.type == "cuda" and x.shape[0] < GEMM_MIN_ROWS_PER_EXPERT * max(1, len(ids)):
        if _kernel_agrees(x, store, m, ids, offs, scale):
            return ck.ggml_rows_grouped_matmul(x.contiguous(), store, m.ggml_type, m.rows, m.nbytes // m.rows, ids,
                                               offs, scale)
    return _decoded_matmul(x, store, m, ids, offs, scale)


def _kernel_agrees(x: torch.Tensor, store: torch.Tensor, m: SlotMatrix, ids: list[int], offs: list[int],
                   scale: torch.Tensor | None) -> bool:
    """Whether the CUDA kernel of ``m``'s type may run: checked once per device and type against the torch path."""
    key = (x.device.index if x.device.index is not None else torch.cuda.current_device(), m.ggml_type)
    known = _kernel_checked.get(key)
    if known is not None:
        return known
    name = q.type_name(m.ggml_type)
    try:
        got = ck.ggml_rows_grouped_matmul(x.contiguous(), store, m.ggml_type, m.rows, m.nbytes // m.rows, ids, offs, scale)
    except Exception as exc:  # no cupy, no NVRTC: the torch path serves
        log.warning("the CUDA kernel for %s rows cannot run (%s): decoding them with torch ops instead", name, exc)
        _kernel_checked[key] = False
        return False
    want = _decoded_matmul(x, store, m, ids, offs, scale)
    err = float((got - want).abs().max()) if want.numel() else 0.0  # the one host sync of the check
    bound = 1e-3 * float(want.abs().max()) if want.numel() else 0.0
    ok = err <= bound
    if not ok:
        log.error("the CUDA kernel for %s rows disagrees with the torch decoders (max error %.3g, allowed %.3g): "
                  "it is not used; please report this with your GPU model", name, err, bound)
    _kernel_checked[key] = ok
    return ok


def _decoded_matmul(x: torch.Tensor, store: torch.Tensor, m: SlotMatrix, ids: list[int], offs: list[int],
                    scale: torch.Tensor | None) -> torch.Tensor:
    """The torch path: the used slots' rows decoded a chunk at a time, then one float32 product per expert."""
    y = torch.zeros((x.shape[0], m.rows), dtype=torch.float32, device=x.device)
    used = [e for e in range(len(ids)) if offs[e + 1] > offs[e]]
    per_chunk = max(1, DEQUANT_CHUNK_BYTES // max(1, m.rows * m.k * 4))
    for c0 in range(0, len(used), per_chunk):
        chunk = used[c0:c0 + per_chunk]
        w = decode_slots(store, m, as_index([ids[e] for e in chunk], "slot_ids", x.device).long())
        for j, e in enumerate(chunk):
            a, b = offs[e], offs[e + 1]
            torch.matmul(x[a:b], w[j].T, out=y[a:b])
            if scale is not None:
                y[a:b] *= scale[ids[e]]
    return y
