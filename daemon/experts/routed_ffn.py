"""All routed experts of one MoE layer on the CPU in one native call (decode and small batches).

The CPU executor (every expert), the hybrid executor's CPU branch (the set C), the emulated
device's slots and calibration all come here, so the speed calibration measures is the speed the
engine gets. Per column the native kernels' arithmetic does not depend on which other experts or
columns share the call, so one expert gives the same bits alone or with others.

Without the native library (no compiler at install, ``MOED_NATIVE=0``), or above
``native_cpu.MAX_TOKENS`` tokens, each expert runs through ``expert_ffn.run_expert`` (numba at
decode, torch GEMMs at prefill), except for quantised banks on CPUs where the native int8 strips
beat dequantising into a GEMM (``prefill_gemm.native_prefill``): those run any number of tokens
natively, ``PREFILL_TOKENS`` tokens per call (the call's scratch grows with its tokens: about 50 KB
per routed token at the bench shape).
"""

from __future__ import annotations

import torch

from moed.cache.host_bank import GGML_BANK, ExpertBank
from moed.experts.executor import merge_expert_outputs
from moed.experts.expert_ffn import ggml_gemm_prefill, run_expert
from moed.kernels.native_cpu import MAX_TOKENS, descriptor_of, native
from moed.kernels.prefill_gemm import native_prefill

PREFILL_TOKENS = 256  # tokens per native call when a prefill runs natively


def uses_native(bank: ExpertBank, num_tokens: int) -> bool:
    """Whether ``num_tokens`` tokens of ``bank`` run through the native MoE call."""
    if num_tokens <= 0 or native() is None:
        return False
    return num_tokens <= MAX_TOKENS or bank.dtype == GGML_BANK or native_prefill(bank.dtype)


def _ggml_layer_ids(bank: ExpertBank, flat_ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The one MoE layer that ``flat_ids`` address and its expert numbers (-1 = not run here). At
    decode this is per layer and step, so it costs a few tensor operations (about 100 us went here
    before: ``moed bench kernels`` measures through it)."""
    e = bank.num_experts
    top = int(flat_ids.max())
    if top < e:  # layer 0, or nothing run (-1 everywhere)
        return 0, flat_ids
    layer = top // e
    run = flat_ids >= 0
    low = int(torch.where(run, flat_ids, top).min())
    if low // e != layer:
        raise ValueError(f"one call runs one MoE layer's experts; these ids span layers {low // e} to {layer}")
    return layer, torch.where(run, flat_ids - layer * e, -1).to(torch.int32)


def _run_ggml(bank: ExpertBank, hidden: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor | None,
              per_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """run_routed for a ggml bank: one layer's experts per native call (the bank is addressed by layer)."""
    lib, n = native(), hidden.shape[0]
    if ggml_gemm_prefill(n):  # a prefill chunk: each expert's rows decoded once, bf16 GEMMs
        return _run_per_expert(bank, hidden, flat_ids, weights, per_slot)
    layer, ids = _ggml_layer_ids(bank, flat_ids)
    if n <= PREFILL_TOKENS:
        return per_slot, lib.moe_ggml(bank, layer, hidden, ids, weights, per_slot=per_slot, merge=weights is not None)
    ys = []
    for t0 in range(0, n, PREFILL_TOKENS):
        rows = slice(t0, min(n, t0 + PREFILL_TOKENS))
        ys.append(lib.moe_ggml(bank, layer, hidden[rows], ids[rows].contiguous(),
                               None if weights is None else weights[rows].contiguous(),
                               per_slot=per_slot[rows], merge=weights is not None))
    return per_slot, None if weights is None else torch.cat(ys)


def run_routed(bank: ExpertBank, hidden: torch.Tensor, flat_ids: torch.Tensor,
               weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden [N, D]`` float32, ``flat_ids [N, A]`` (bank flat ids; -1 = not run here) ->
    ``(per_slot [N, A, D], y)``: per_slot holds each run slot's expert output (other rows are
    unspecified); ``y [N, D]`` is the weighted sum over the run slots in ascending slot order
    (the executor contract) when ``weights [N, A]`` is given, else None."""
    if hidden.dim() != 2 or hidden.shape[1] != bank.hidden_size or hidden.dtype != torch.float32:
        raise ValueError(f"hidden must be float32 [N, {bank.hidden_size}], got {hidden.dtype} {tuple(hidden.shape)}")
    n, a = flat_ids.shape
    per_slot = torch.empty(n, a, bank.hidden_size, dtype=torch.float32)
    if uses_native(bank, n) and bank.dtype == GGML_BANK:
        return _run_ggml(bank, hidden, flat_ids, weights, per_slot)
    if uses_native(bank, n):
        lib, desc = native(), descriptor_of(bank)
        if n <= PREFILL_TOKENS:
            return per_slot, lib.moe(desc, hidden, flat_ids, weights, per_slot=per_slot, merge=weights is not None)
        ys = []
        for t0 in range(0, n, PREFILL_TOKENS):
            rows = slice(t0, min(n, t0 + PREFILL_TOKENS))
            ys.append(lib.moe(desc, hidden[rows], flat_ids[rows].contiguous(),
                              None if weights is None else weights[rows].contiguous(),
                              per_slot=per_slot[rows], merge=weights is not None))
        return per_slot, None if weights is None else torch.cat(ys)
    return _run_per_expert(bank, hidden, flat_ids, weights, per_slot)


def _run_per_expert(bank: ExpertBank, hidden: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor | None,
                    per_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One expert at a time (run_expert): the fallback, and a ggml bank's prefill."""
    n, a = flat_ids.shape
    flat = flat_ids.reshape(-1)
    run = flat >= 0
    rows = per_slot.view(-1, bank.hidden_size)
    for fid in torch.unique(flat[run]).tolist():
        picks = torch.nonzero(flat == fid).reshape(-1)
        rows[picks] = run_expert(bank, fid, hidden[picks // a].contiguous())
    y = None
    if weights is not None:
        if bool(run.all()):
            y = merge_expert_outputs(per_slot, weights)
        else:  # only the run slots count
            masked = torch.where(run.view(n, a, 1), per_slot, torch.zeros(()))
            y = merge_expert_outputs(masked, torch.where(run.view(n, a), weights, torch.zeros(())))
    return per_slot, y
