"""One routed expert's FFN on the CPU: gate_up matmul, gated activation, down matmul (plus optional biases).

Decode (``T <= DIRECT_MAX_TOKENS``) runs the whole expert in one numba call: at a few tens of
microseconds per expert, per-call Python overhead (tensor indexing, numpy views, dispatch of
separate matmuls and torch ops, ~20 us) would otherwise cost a large share of the bandwidth.
The numpy views of a bank are built once and cached per bank object. Prefill runs
``expert_matmul`` (dequantize + ``torch.matmul``) and the torch activation.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numba
import numpy as np
import torch
import torch.nn.functional as F

from moed.cache.host_bank import GGML_BANK, ExpertActivation, ExpertBank
from moed.kernels.expert_matmul import (
    DIRECT_MAX_TOKENS,
    check_matrix,
    expert_matmul,
    expert_matmul_reference,
    launch_guard,
    matmul_bf16_kernel,
    matmul_fp32_kernel,
    matmul_int4_kernel,
    matmul_mxfp4_kernel,
    matmul_q8_kernel,
    matrix_arrays,
    serial_njit,
)

from moed.kernels.native_cpu import MAX_TOKENS as NATIVE_MAX_TOKENS
from moed.kernels.expert_matmul import PREFILL_ROW_BUCKET
from moed.kernels.ggml_rows_format import dequantize_rows
from moed.kernels.prefill_gemm import prefill_gemm_dtype
from moed.kernels.native_cpu import descriptor_of, native

_Matmul = Callable[[dict[str, torch.Tensor], str, int, torch.Tensor], torch.Tensor]
_KIND_CODES = {"silu": 0, "gpt_oss": 1, "clamped_silu": 2, "relu2": 3, "gelu_tanh": 4}


def apply_activation(gate_up: torch.Tensor, act: ExpertActivation) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate columns first, then up) -> ``[T, I]``."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if act.kind == "silu":
        return F.silu(gate) * up
    if act.kind == "relu2":  # Nemotron-H: gate and up are the same matrix, so this is relu(up)^2
        return F.relu(gate) * up
    if act.kind == "gelu_tanh":  # Gemma-4's GeGLU
        return F.gelu(gate, approximate="tanh") * up
    if act.kind == "clamped_silu":  # DeepSeek-V4: SwiGLU on gate <= limit and |up| <= limit
        return F.silu(gate.clamp(max=act.limit)) * up.clamp(min=-act.limit, max=act.limit)
    # gpt_oss: clamped SwiGLU with a sigmoid gate and an up that is shifted by one.
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    glu = gate * torch.sigmoid(gate * act.alpha)
    return (up + 1.0) * glu


# --------------------------------------------------------------------------- numba decode path
# One numba call per expert: two parallel matmuls (each thread streams its own contiguous block
# of K rows) around a serial activation. Tried and dropped: one parallel region per expert with
# each thread owning a chunk of the intermediate columns (no barrier, but gate_up is then read
# in short strided segments, which streamed from DRAM ~20% slower).


@serial_njit
def _activate(
    gate: np.ndarray,
    up: np.ndarray,
    gu_bias: np.ndarray,
    fid: int,
    kind: int,
    alpha: float,
    limit: float,
    out: np.ndarray,
) -> None:
    # gate/up [T, I] (+ gu_bias[fid] when the bank has biases: gu_bias is [N, 2I], or [0, 2I]
    # without) -> out [T, I]; the numba twin of apply_activation
    ntok, inter = out.shape
    has_bias = gu_bias.shape[0] > 0
    al = np.float32(alpha)
    lim = np.float32(limit)
    one = np.float32(1.0)
    for t in range(ntok):
        for j in range(inter):
            g = gate[t, j]
            u = up[t, j]
            if has_bias:
                g += gu_bias[fid, j]
                u += gu_bias[fid, inter + j]
            if kind == 0:
                out[t, j] = g / (one + np.exp(-g)) * u
            elif kind == 3:
                out[t, j] = max(g, np.float32(0.0)) * u
            elif kind == 4:
                inner = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
                out[t, j] = np.float32(0.5) * g * (one + np.tanh(inner)) * u
            elif kind == 2:
                g = min(g, lim)
                u = max(min(u, lim), -lim)
                out[t, j] = g / (one + np.exp(-g)) * u
            else:
                g = min(g, lim)
                u = max(min(u, lim), -lim)
                out[t, j] = (u + one) * (g / (one + np.exp(-g * al)))


@serial_njit
def _add_bias(y: np.ndarray, bias: np.ndarray, fid: int) -> None:
    # y [T, D] += bias[fid] when the bank has biases (bias [N, D], or [0, D] without)
    if bias.shape[0] > 0:
        b = bias[fid]
        for t in range(y.shape[0]):
            yt = y[t]
            for j in range(yt.shape[0]):
                yt[j] += b[j]


@serial_njit
def _expert_fp32(
    x: np.ndarray,
    gu: np.ndarray,
    gu_b: np.ndarray,
    dn: np.ndarray,
    dn_b: np.ndarray,
    fid: int,
    kind: int,
    alpha: float,
    limit: float,
    nparts: int,
) -> np.ndarray:
    # x [T, D] f32; gu [N, D, 2I], dn [N, I, D] float32 -> y [T, D]
    ntok = x.shape[0]
    inter = dn.shape[1]
    h = np.empty((ntok, 2 * inter), np.float32)
    matmul_fp32_kernel(x, gu[fid], nparts, h)
    a = np.empty((ntok, inter), np.float32)
    _activate(h[:, :inter], h[:, inter:], gu_b, fid, kind, alpha, limit, a)
    y = np.empty((ntok, dn.shape[2]), np.float32)
    matmul_fp32_kernel(a, dn[fid], nparts, y)
    _add_bias(y, dn_b, fid)
    return y


@serial_njit
def _expert_bf16(
    x: np.ndarray,
    gu: np.ndarray,
    gu_b: np.ndarray,
    dn: np.ndarray,
    dn_b: np.ndarray,
    fid: int,
    kind: int,
    alpha: float,
    limit: float,
    nparts: int,
) -> np.ndarray:
    # as _expert_fp32 with gu/dn as uint16 bf16 bits
    ntok = x.shape[0]
    inter = dn.shape[1]
    h = np.empty((ntok, 2 * inter), np.float32)
    matmul_bf16_kernel(x, gu[fid], nparts, h)
    a = np.empty((ntok, inter), np.float32)
    _activate(h[:, :inter], h[:, inter:], gu_b, fid, kind, alpha, limit, a)
    y = np.empty((ntok, dn.shape[2]), np.float32)
    matmul_bf16_kernel(a, dn[fid], nparts, y)
    _add_bias(y, dn_b, fid)
    return y


@serial_njit
def _expert_int4(
    x: np.ndarray,
    gq: np.ndarray,
    gs: np.ndarray,
    gm: np.ndarray,
    gu_b: np.ndarray,
    dq: np.ndarray,
    ds: np.ndarray,
    dm: np.ndarray,
    dn_b: np.ndarray,
    fid: int,
    kind: int,
    alpha: float,
    limit: float,
    nparts: int,
) -> np.ndarray:
    # as _expert_fp32 with each matrix as (q uint8 [N, K, Ncols/2], scale/min uint16 [N, K/32, Ncols])
    ntok = x.shape[0]
    inter = dq.shape[1]
    h = np.empty((ntok, 2 * inter), np.float32)
    matmul_int4_kernel(x, gq[fid], gs[fid], gm[fid], nparts, h)
    a = np.empty((ntok, inter), np.float32)
    _activate(h[:, :inter], h[:, inter:], gu_b, fid, kind, alpha, limit, a)
    y = np.empty((ntok, ds.shape[2]), np.float32)
    matmul_int4_kernel(a, dq[fid], ds[fid], dm[fid], nparts, y)
    _add_bias(y, dn_b, fid)
    return y


@serial_njit
def _expert_q8(
    x: np.ndarray,
    gqs: np.ndarray,
    gd: np.ndarray,
    gu_b: np.ndarray,
    dqs: np.ndarray,
    dd: np.ndarray,
    dn_b: np.ndarray,
    fid: int,
    kind: int,
    alpha: float,
    limit: float,
    nparts: int,
) -> np.ndarray:
    # as _expert_fp32 with each matrix as (qs int8 [N, K, Ncols], d uint16 fp16 bits [N, K/32, Ncols])
    ntok = x.shape[0]
    inter = dqs.shape[1]
    h = np.empty((ntok, 2 * inter), np.float32)
    matmul_q8_kernel(x, gqs[fid], gd[fid], nparts, h)
    a = np.empty((ntok, inter), np.float32)
    _activate(h[:, :inter], h[:, inter:], gu_b, fid, kind, alpha, limit, a)
    y = np.empty((ntok, dqs.shape[2]), np.float32)
    matmul_q8_kernel(a, dqs[fid], dd[fid], nparts, y)
    _add_bias(y, dn_b, fid)
    return y


@serial_njit
def _expert_mxfp4(
    x: np.ndarray,
    gfp4: np.ndarray,
    ge: np.ndarray,
    gu_b: np.ndarray,
    dfp4: np.ndarray,
    de: np.ndarray,
    dn_b: np.ndarray,
    fid: int,
    kind: int,
    alpha: float,
    limit: float,
    nparts: int,
) -> np.ndarray:
    # as _expert_fp32 with each matrix as (fp4 uint8 [N, K, Ncols/2], e8m0 uint8 [N, K/32, Ncols])
    ntok = x.shape[0]
    inter = dfp4.shape[1]
    h = np.empty((ntok, 2 * inter), np.float32)
    matmul_mxfp4_kernel(x, gfp4[fid], ge[fid], nparts, h)
    a = np.empty((ntok, inter), np.float32)
    _activate(h[:, :inter], h[:, inter:], gu_b, fid, kind, alpha, limit, a)
    y = np.empty((ntok, de.shape[2]), np.float32)
    matmul_mxfp4_kernel(a, dfp4[fid], de[fid], nparts, y)
    _add_bias(y, dn_b, fid)
    return y


_FFN_KERNELS = {"fp32": _expert_fp32, "bf16": _expert_bf16, "int4": _expert_int4, "q8": _expert_q8,
                "mxfp4": _expert_mxfp4}


@dataclass
class _BankViews:
    """Checked numpy views of one bank for the numba path; valid while the bank is unchanged."""

    bank: weakref.ref[ExpertBank]
    sources: dict[str, torch.Tensor]  # the tensors the views were made from (identity check)
    activation: ExpertActivation
    kernel: Any
    arrays: tuple[np.ndarray, ...]  # gate_up arrays, gate_up bias, down arrays, down bias
    act_args: tuple[int, float, float]  # kind code, alpha, limit

    def matches(self, bank: ExpertBank) -> bool:
        tensors = bank.tensors
        return (
            self.bank() is bank
            and self.activation is bank.activation
            and len(tensors) == len(self.sources)
            and all(tensors.get(k) is t for k, t in self.sources.items())
        )


_views_cache: dict[int, _BankViews] = {}


def _bias_array(bank: ExpertBank, key: str, width: int) -> np.ndarray:
    """Bias ``[N, width]`` float32, or an empty ``[0, width]`` (same numba type) without one."""
    t = bank.tensors.get(key)
    if t is None:
        return np.zeros((0, width), np.float32)
    want = (bank.num_slots, width)
    if t.dtype != torch.float32 or tuple(t.shape) != want or not t.is_contiguous():
        raise ValueError(f"bank {key!r} must be contiguous float32 {want}, got {t.dtype} {tuple(t.shape)}")
    return t.numpy()


def _build_views(bank: ExpertBank) -> _BankViews:
    d, inter = bank.hidden_size, bank.intermediate_size
    fmt_gu, n_gu, k_gu, c_gu = check_matrix(bank.tensors, "gate_up")
    fmt_dn, n_dn, k_dn, c_dn = check_matrix(bank.tensors, "down")
    if fmt_gu != fmt_dn:
        raise ValueError(f"gate_up is {fmt_gu} but down is {fmt_dn}")
    if (n_gu, k_gu, c_gu) != (bank.num_slots, d, 2 * inter) or (n_dn, k_dn, c_dn) != (bank.num_slots, inter, d):
        raise ValueError(
            f"bank matrices do not match its sizes: gate_up {n_gu}x{k_gu}x{c_gu}, down {n_dn}x{k_dn}x{c_dn}, "
            f"expected {bank.num_slots}x{d}x{2 * inter} and {bank.num_slots}x{inter}x{d}"
        )
    if ("gate_up_bias" in bank.tensors) != ("down_bias" in bank.tensors):
        raise ValueError("bank has only one of gate_up_bias / down_bias")
    arrays = (
        *matrix_arrays(bank.tensors, "gate_up"),
        _bias_array(bank, "gate_up_bias", 2 * inter),
        *matrix_arrays(bank.tensors, "down"),
        _bias_array(bank, "down_bias", d),
    )
    act = bank.activation
    # fastmath assumes finite values: an infinite limit becomes a huge finite one
    limit = act.limit if math.isfinite(act.limit) else 3.0e38
    act_args = (_KIND_CODES[act.kind], float(act.alpha), float(limit))
    return _BankViews(weakref.ref(bank), dict(bank.tensors), act, _FFN_KERNELS[fmt_gu], arrays, act_args)


def _views_of(bank: ExpertBank) -> _BankViews:
    views = _views_cache.get(id(bank))
    if views is None or not views.matches(bank):
        views = _build_views(bank)
        key = id(bank)
        if key not in _views_cache:
            weakref.finalize(bank, _views_cache.pop, key, None)  # the entry dies with the bank
        _views_cache[key] = views
    return views


# --------------------------------------------------------------------------- public


def _check_call(bank: ExpertBank, flat_id: int, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != bank.hidden_size:
        raise ValueError(f"x must be [T, {bank.hidden_size}], got {tuple(x.shape)}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be float32 on the CPU, got {x.dtype} on {x.device}")
    if not 0 <= flat_id < bank.num_slots:
        raise ValueError(f"flat_id {flat_id} out of range (bank has {bank.num_slots} experts)")


def _run_torch(bank: ExpertBank, flat_id: int, x: torch.Tensor, matmul: _Matmul) -> torch.Tensor:
    x = x.contiguous()
    h = matmul(bank.tensors, "gate_up", flat_id, x)  # [T, 2I]
    if "gate_up_bias" in bank.tensors:
        h = h + bank.tensors["gate_up_bias"][flat_id]
    a = apply_activation(h, bank.activation).contiguous()  # [T, I]
    y = matmul(bank.tensors, "down", flat_id, a)  # [T, D]
    if "down_bias" in bank.tensors:
        y = y + bank.tensors["down_bias"][flat_id]
    return y


def ggml_gemm_prefill(num_tokens: int) -> bool:
    """Whether ``num_tokens`` tokens of one ggml-bank expert multiply in bf16 GEMMs (the expert's rows
    decoded to bf16 once, natively) instead of the int8 row kernels, which decode every row once per
    token: above the decode sizes, on CPUs whose bf16 GEMMs are native (prefill_gemm.py)."""
    return (num_tokens > NATIVE_MAX_TOKENS and native() is not None
            and prefill_gemm_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16)


def ggml_expert_gemm(bank: ExpertBank, flat_id: int, x: torch.Tensor) -> torch.Tensor:
    """One ggml-bank expert on many tokens: its rows decoded to bf16 (bit for bit gguf's values, rounded
    once) and multiplied in bf16 GEMMs with float32 results, as the other banks' prefill does."""
    layer, expert = divmod(flat_id, bank.num_experts)
    lib = native()
    rows = x.shape[0]
    padded = x.new_zeros((-(-rows // PREFILL_ROW_BUCKET) * PREFILL_ROW_BUCKET, x.shape[1]), dtype=torch.bfloat16)
    padded[:rows] = x

    def times(kind: str, k: int, a: torch.Tensor) -> torch.Tensor:
        t, ggml_type = bank.ggml_matrix(kind, layer)
        out = torch.matmul(a, lib.ggml_to_bf16(t[expert], ggml_type, k).T)[:rows].float()
        return _ggml_scaled(out, bank, kind, layer, expert)

    h = torch.cat([times("gate", bank.hidden_size, padded), times("up", bank.hidden_size, padded)], dim=1)
    if "gate_up_bias" in bank.tensors:
        h = h + bank.tensors["gate_up_bias"][flat_id]
    a = apply_activation(h, bank.activation)
    down_in = a.new_zeros(padded.shape[0], a.shape[1], dtype=torch.bfloat16)
    down_in[:rows] = a
    y = times("down", bank.intermediate_size, down_in)
    if "down_bias" in bank.tensors:
        y = y + bank.tensors["down_bias"][flat_id]
    return y


def _ggml_scaled(out: torch.Tensor, bank: ExpertBank, kind: str, layer: int, expert: int) -> torch.Tensor:
    """A ggml-bank matrix's outputs times its factor for ``expert`` (an NVFP4 checkpoint's global
    scale, host_bank.py), as the native kernels apply it: before the biases."""
    scale = bank.ggml_scale(kind, layer)
    return out if scale is None else out * scale[expert]


def _run_ggml(bank: ExpertBank, flat_id: int, x: torch.Tensor) -> torch.Tensor:
    """One expert of a ggml bank: the native kernels when built (bf16 GEMMs on decoded rows for many
    tokens), else torch on the gguf-decoded rows."""
    layer, expert = divmod(flat_id, bank.num_experts)
    lib = native()
    if lib is not None and ggml_gemm_prefill(x.shape[0]):
        return ggml_expert_gemm(bank, flat_id, x)
    if lib is not None:
        per_slot = torch.empty(x.shape[0], 1, bank.hidden_size)
        ids = torch.full((x.shape[0], 1), expert, dtype=torch.int32)
        lib.moe_ggml(bank, layer, x.contiguous(), ids, None, per_slot=per_slot, merge=False)
        return per_slot.view(x.shape[0], bank.hidden_size)
    mats = {}
    for kind, k in (("gate", bank.hidden_size), ("up", bank.hidden_size), ("down", bank.intermediate_size)):
        t, ggml_type = bank.ggml_matrix(kind, layer)
        mats[kind] = dequantize_rows(t[expert], ggml_type, k)  # [rows, k] float32
    h = torch.cat([_ggml_scaled(x @ mats["gate"].T, bank, "gate", layer, expert),
                   _ggml_scaled(x @ mats["up"].T, bank, "up", layer, expert)], dim=1)
    if "gate_up_bias" in bank.tensors:
        h = h + bank.tensors["gate_up_bias"][flat_id]
    y = _ggml_scaled(apply_activation(h, bank.activation) @ mats["down"].T, bank, "down", layer, expert)
    if "down_bias" in bank.tensors:
        y = y + bank.tensors["down_bias"][flat_id]
    return y


def run_expert(bank: ExpertBank, flat_id: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``flat_id`` applied to ``x [T, D]`` float32 -> ``[T, D]`` float32: the native kernels (int8
    activations for the quantised dtypes, see moed_cpu.h), else the numba ones, at decode; torch
    GEMMs above ``DIRECT_MAX_TOKENS``. A ggml bank runs natively at any size (or in torch without
    the native library)."""
    _check_call(bank, flat_id, x)
    if bank.dtype == GGML_BANK:
        return _run_ggml(bank, flat_id, x)
    ntok = x.shape[0]
    if ntok == 0 or ntok > DIRECT_MAX_TOKENS:
        return _run_torch(bank, flat_id, x, expert_matmul)
    lib = native()
    if lib is not None and ntok <= NATIVE_MAX_TOKENS:
        per_slot = torch.empty(ntok, 1, bank.hidden_size)
        ids = torch.full((ntok, 1), flat_id, dtype=torch.int32)
        lib.moe(descriptor_of(bank), x, ids, None, per_slot=per_slot, merge=False)
        return per_slot.view(ntok, bank.hidden_size)
    views = _views_of(bank)
    xn = x.contiguous().numpy()
    with launch_guard():
        # one part per numba thread (get_num_threads inside a kernel would defeat caching)
        y = views.kernel(xn, *views.arrays, flat_id, *views.act_args, numba.get_num_threads())
    return torch.from_numpy(y)


def run_expert_reference(bank: ExpertBank, flat_id: int, x: torch.Tensor) -> torch.Tensor:
    """Plain-torch twin of ``run_expert`` (dequantize, then ``torch.matmul``)."""
    _check_call(bank, flat_id, x)
    return _run_torch(bank, flat_id, x, expert_matmul_reference)
