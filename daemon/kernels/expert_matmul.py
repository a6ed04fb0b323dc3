"""CPU matmul ``y[T, N] = x[T, K] @ W[K, N]`` of one bank expert (any bank dtype): numba kernels + torch reference.

Decode (``T <= DIRECT_MAX_TOKENS``) runs numba kernels that read each weight byte once per
call: the reduction dimension K is split into one contiguous block of rows per thread (each
thread streams its own part of the matrix front to back, into its own partial sum), and every
group of four rows feeds one long contiguous loop over the output columns, which LLVM
vectorises (AVX-512 here). bf16 is widened by a shift and a bitcast; int4 nibbles become the
float ``1 + q/16`` by placing them in the mantissa (no int->float conversion), and scale/min
are applied once per group of 32 rows. q8 and mxfp4 (block_scaled_matmul.py) work the same
way with one scale per group. Prefill (more tokens) lets ``torch.matmul`` do a GEMM: in float32
for fp32 banks, in bf16 for the others (their matrix as bf16, dequantised first when packed).

Accuracy contract (checked by tests/kernels/test_expert_matmul.py): elementwise
``|y - y_ref| <= MATMUL_RTOL * (|x| @ A)`` with ``MATMUL_RTOL = 1e-5``, where ``y_ref`` is
``expert_matmul_reference`` (weights dequantized to float32, then ``torch.matmul``), ``A = |W|``
for fp32/bf16/q8/mxfp4 and ``A = (q + 16) * |scale| + |min|`` for int4. Only the float32
summation order differs (observed: < 1e-6 of the bound): the int4 kernel sums ``(1 + q/16) * x``
over each group of 32 and applies ``scale`` and ``min`` once per group, hence the
``16 * |scale|`` term; q8 and mxfp4 sum the exact codes times ``x`` and apply the scale once,
so their terms are the weights themselves. The bf16 prefill GEMM (``T > DIRECT_MAX_TOKENS``, all
but fp32 banks) rounds x, the dequantised weights and the result to bf16: its bound is
``PREFILL_RTOL * (|x| @ A)`` with ``PREFILL_RTOL = 2**-7`` (three roundings of 2**-9 each).

Threads and the launch guard: numba_runtime.py (re-exported here).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from moed.kernels.block_scaled_matmul import (
    dequant_mxfp4_kernel,
    dequant_q8_kernel,
    matmul_mxfp4_kernel,
    matmul_q8_kernel,
)
from moed.kernels.int4_format import INT4_GROUP_SIZE, dequantize_int4
from moed.kernels.mxfp4_format import MXFP4_GROUP_SIZE, dequantize_mxfp4
from moed.kernels.numba_runtime import (  # noqa: F401  (re-exported: the kernels' public setup)
    configure_threads,
    launch_guard,
    parallel_njit,
    reduce_parts,
    serial_njit,
    threading_layer,
)
from moed.kernels.prefill_gemm import prefill_gemm_dtype
from moed.kernels.q8_format import Q8_GROUP_SIZE, dequantize_q8

MATMUL_RTOL = 1e-5
PREFILL_RTOL = 2.0**-7
# an expert's token count in a prefill GEMM is rounded up to a multiple of this (zero rows, dropped after):
# oneDNN compiles and caches a primitive per GEMM shape, and its caches are capped (moed/__init__.py);
# with one shape per token count a 512-token chunk's experts cycle through more shapes than the caches
# hold and every GEMM re-creates its primitive (8k prompt, q8 bank: TTFT 15.2 -> 21.8 s at 128 entries)
PREFILL_ROW_BUCKET = 16
DIRECT_MAX_TOKENS = 16  # above this, a torch GEMM (bf16 for all but fp32 banks: _prefill_matmul)
MATRIX_NAMES = ("gate_up", "down")
_G = INT4_GROUP_SIZE


# --------------------------------------------------------------------------- scalar bit tricks
# numba has no scalar bitcast and widens small-integer arithmetic to 64 bits, which turns the
# vectorised loops into 8-lane int64 conversions; these intrinsics emit 32-bit LLVM IR instead.

_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_ONE_BITS = 0x3F800000  # 1.0f
_NIB_MASK = 0x00780000  # float32 mantissa bits 19..22: a nibble there adds nibble/16


def _to_i32(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    width = v.type.width
    return builder.zext(v, _I32) if width < 32 else builder.trunc(v, _I32) if width > 32 else v


@intrinsic
def _bf16_f32(typingctx: Any, bits: types.Type) -> Any:
    """bf16 bits (any integer type) -> float32: the bits are the high half of a float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        return builder.bitcast(builder.shl(_to_i32(builder, args[0]), ir.Constant(_I32, 16)), _F32)

    return types.float32(bits), codegen


def _nibble_intrinsic(shift: int) -> Any:
    """uint8 -> ``1 + nibble / 16`` as float32, with the nibble at bits ``[shift, shift + 4)``.

    Building the float from its bits (shift, mask, or: two vector ops, the last two fuse into
    one ``vpternlogd``) replaces an int->float conversion; the ``1 +`` is removed per group.
    """

    @intrinsic
    def nib(typingctx: Any, b: types.Type) -> Any:
        if b != types.uint8:
            return None

        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
            v = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 19 - shift))
            v = builder.or_(builder.and_(v, ir.Constant(_I32, _NIB_MASK)), ir.Constant(_I32, _ONE_BITS))
            return builder.bitcast(v, _F32)

        return types.float32(b), codegen

    return nib


_nib_lo = _nibble_intrinsic(0)
_nib_hi = _nibble_intrinsic(4)


@intrinsic
def _nib_lo_exact(typingctx: Any, b: types.Type) -> Any:
    """uint8 -> float32(low nibble), on 8-bit lanes."""
    if b != types.uint8:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        return builder.uitofp(builder.and_(args[0], ir.Constant(ir.IntType(8), 15)), _F32)

    return types.float32(b), codegen


@intrinsic
def _nib_hi_exact(typingctx: Any, b: types.Type) -> Any:
    """uint8 -> float32(high nibble), on 8-bit lanes."""
    if b != types.uint8:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        return builder.uitofp(builder.lshr(args[0], ir.Constant(ir.IntType(8), 4)), _F32)

    return types.float32(b), codegen


# --------------------------------------------------------------------------- kernels
# Building blocks ``acc_*`` add one block of ``x @ W`` (a range of K rows, a range of columns)
# into an accumulator; the parallel kernels give each thread one contiguous block of K rows
# and its own partial sum ``part[p]`` [T, N], summed by ``reduce_parts``. Rows go four at a time
# so every accumulator load/store serves four weights. Loops index 1-D slices with ``range``
# indices, which LLVM can prove non-negative (no wraparound test), so they vectorise.


@serial_njit
def acc_fp32(x: np.ndarray, xk0: int, w: np.ndarray, k0: int, k1: int, c0: int, acc: np.ndarray) -> None:
    # acc [T, nc] += x[:, xk0 : xk0 + k1 - k0] @ w[k0:k1, c0 : c0 + nc]; w float32 [K, N]
    ntok, nc = acc.shape
    k4 = k0 + (k1 - k0) // 4 * 4
    for k in range(k0, k4, 4):
        w0 = w[k, c0 : c0 + nc]
        w1 = w[k + 1, c0 : c0 + nc]
        w2 = w[k + 2, c0 : c0 + nc]
        w3 = w[k + 3, c0 : c0 + nc]
        xk = xk0 + k - k0
        for t in range(ntok):
            x0 = x[t, xk]
            x1 = x[t, xk + 1]
            x2 = x[t, xk + 2]
            x3 = x[t, xk + 3]
            at = acc[t]
            for j in range(nc):
                at[j] += (w0[j] * x0 + w1[j] * x1) + (w2[j] * x2 + w3[j] * x3)
    for k in range(k4, k1):
        w0 = w[k, c0 : c0 + nc]
        for t in range(ntok):
            x0 = x[t, xk0 + k - k0]
            at = acc[t]
            for j in range(nc):
                at[j] += w0[j] * x0


@serial_njit
def acc_bf16(x: np.ndarray, xk0: int, w: np.ndarray, k0: int, k1: int, c0: int, acc: np.ndarray) -> None:
    # as acc_fp32 with w uint16 bf16 bits [K, N]
    ntok, nc = acc.shape
    k4 = k0 + (k1 - k0) // 4 * 4
    for k in range(k0, k4, 4):
        w0 = w[k, c0 : c0 + nc]
        w1 = w[k + 1, c0 : c0 + nc]
        w2 = w[k + 2, c0 : c0 + nc]
        w3 = w[k + 3, c0 : c0 + nc]
        xk = xk0 + k - k0
        for t in range(ntok):
            x0 = x[t, xk]
            x1 = x[t, xk + 1]
            x2 = x[t, xk + 2]
            x3 = x[t, xk + 3]
            at = acc[t]
            for j in range(nc):
                at[j] += (_bf16_f32(w0[j]) * x0 + _bf16_f32(w1[j]) * x1) + (
                    _bf16_f32(w2[j]) * x2 + _bf16_f32(w3[j]) * x3
                )
    for k in range(k4, k1):
        w0 = w[k, c0 : c0 + nc]
        for t in range(ntok):
            x0 = x[t, xk0 + k - k0]
            at = acc[t]
            for j in range(nc):
                at[j] += _bf16_f32(w0[j]) * x0


@serial_njit
def acc_int4(
    x: np.ndarray,
    xk0: int,
    q: np.ndarray,
    scale: np.ndarray,
    mn: np.ndarray,
    g0: int,
    g1: int,
    b0: int,
    acc: np.ndarray,
) -> None:
    # Groups [g0, g1) (rows [32 g0, 32 g1)), bytes [b0, b0 + nb) of q [K, N/2] uint8, scale/mn
    # [K/32, N] uint16 bf16 bits: acc [T, 2 nb] += columns [b0, b0 + nb) (low nibbles) then
    # columns N/2 + [b0, b0 + nb) (high nibbles); x column xk0 is row 32 g0. With nb = N/2
    # that is plain column order; with a chunk it puts gate and up of the chunk side by side.
    # Per group and token, lo/hi collect sum_k (1 + q_k/16) x_k and xsum = sum_k x_k, then
    # sum_k w_k x_k = scale * sum_k q_k x_k + min * xsum = 16 scale * lo + (min - 16 scale) * xsum.
    ntok = acc.shape[0]
    nb = acc.shape[1] // 2
    half = q.shape[1]
    lo = np.empty((ntok, nb), np.float32)
    hi = np.empty((ntok, nb), np.float32)
    xsum = np.empty(ntok, np.float32)
    for g in range(g0, g1):
        k = g * 32
        xk = xk0 + k - g0 * 32
        for kk in range(0, 32, 4):
            q0 = q[k + kk, b0 : b0 + nb]
            q1 = q[k + kk + 1, b0 : b0 + nb]
            q2 = q[k + kk + 2, b0 : b0 + nb]
            q3 = q[k + kk + 3, b0 : b0 + nb]
            for t in range(ntok):
                x0 = x[t, xk + kk]
                x1 = x[t, xk + kk + 1]
                x2 = x[t, xk + kk + 2]
                x3 = x[t, xk + kk + 3]
                lt = lo[t]
                ht = hi[t]
                if kk == 0:  # first rows of the group: set, do not add
                    xsum[t] = (x0 + x1) + (x2 + x3)
                    for j in range(nb):
                        e0 = q0[j]
                        e1 = q1[j]
                        e2 = q2[j]
                        e3 = q3[j]
                        lt[j] = (_nib_lo(e0) * x0 + _nib_lo(e1) * x1) + (_nib_lo(e2) * x2 + _nib_lo(e3) * x3)
                        ht[j] = (_nib_hi(e0) * x0 + _nib_hi(e1) * x1) + (_nib_hi(e2) * x2 + _nib_hi(e3) * x3)
                else:
                    xsum[t] += (x0 + x1) + (x2 + x3)
                    for j in range(nb):
                        e0 = q0[j]
                        e1 = q1[j]
                        e2 = q2[j]
                        e3 = q3[j]
                        lt[j] += (_nib_lo(e0) * x0 + _nib_lo(e1) * x1) + (_nib_lo(e2) * x2 + _nib_lo(e3) * x3)
                        ht[j] += (_nib_hi(e0) * x0 + _nib_hi(e1) * x1) + (_nib_hi(e2) * x2 + _nib_hi(e3) * x3)
        s_lo = scale[g, b0 : b0 + nb]
        s_hi = scale[g, half + b0 : half + b0 + nb]
        m_lo = mn[g, b0 : b0 + nb]
        m_hi = mn[g, half + b0 : half + b0 + nb]
        for t in range(ntok):
            xs = xsum[t]
            lt = lo[t]
            ht = hi[t]
            a_lo = acc[t, :nb]
            a_hi = acc[t, nb:]
            for j in range(nb):
                s16 = _bf16_f32(s_lo[j]) * np.float32(16.0)
                a_lo[j] += s16 * lt[j] + (_bf16_f32(m_lo[j]) - s16) * xs
            for j in range(nb):
                s16 = _bf16_f32(s_hi[j]) * np.float32(16.0)
                a_hi[j] += s16 * ht[j] + (_bf16_f32(m_hi[j]) - s16) * xs


@parallel_njit
def matmul_fp32_kernel(x: np.ndarray, w: np.ndarray, nparts: int, out: np.ndarray) -> None:
    # x [T, K] f32, w [K, N] f32, out [T, N] f32
    k_dim = x.shape[1]
    part = np.zeros((nparts, x.shape[0], w.shape[1]), np.float32)
    rows = (k_dim + nparts - 1) // nparts
    for p in prange(nparts):
        k0 = min(k_dim, p * rows)
        k1 = min(k_dim, k0 + rows)
        acc_fp32(x, k0, w, k0, k1, 0, part[p])
    reduce_parts(part, out)


@parallel_njit
def matmul_bf16_kernel(x: np.ndarray, w: np.ndarray, nparts: int, out: np.ndarray) -> None:
    # x [T, K] f32, w [K, N] uint16 (bf16 bits), out [T, N] f32
    k_dim = x.shape[1]
    part = np.zeros((nparts, x.shape[0], w.shape[1]), np.float32)
    rows = (k_dim + nparts - 1) // nparts
    for p in prange(nparts):
        k0 = min(k_dim, p * rows)
        k1 = min(k_dim, k0 + rows)
        acc_bf16(x, k0, w, k0, k1, 0, part[p])
    reduce_parts(part, out)


@parallel_njit
def matmul_int4_kernel(
    x: np.ndarray, q: np.ndarray, scale: np.ndarray, mn: np.ndarray, nparts: int, out: np.ndarray
) -> None:
    # x [T, K] f32, q [K, N/2] uint8, scale/mn [K/G, N] uint16 (bf16 bits), out [T, N] f32
    groups = x.shape[1] // 32
    half = q.shape[1]
    part = np.zeros((nparts, x.shape[0], 2 * half), np.float32)
    per = (groups + nparts - 1) // nparts
    for p in prange(nparts):
        g0 = min(groups, p * per)
        g1 = min(groups, g0 + per)
        acc_int4(x, g0 * 32, q, scale, mn, g0, g1, 0, part[p])
    reduce_parts(part, out)


@parallel_njit
def _dequant_int4(q: np.ndarray, scale: np.ndarray, mn: np.ndarray, out: np.ndarray) -> None:
    # q [K, N/2] uint8, scale/mn [K/G, N] uint16 -> out [K, N] f32
    k_dim, half = q.shape
    for g in prange(k_dim // 32):
        sg = scale[g]
        mg = mn[g]
        s_lo, s_hi, m_lo, m_hi = sg[:half], sg[half:], mg[:half], mg[half:]
        for k in range(g * 32, g * 32 + 32):
            qk = q[k]
            o_lo = out[k, :half]
            o_hi = out[k, half:]
            for j in range(half):
                o_lo[j] = _nib_lo_exact(qk[j]) * _bf16_f32(s_lo[j]) + _bf16_f32(m_lo[j])
            for j in range(half):
                o_hi[j] = _nib_hi_exact(qk[j]) * _bf16_f32(s_hi[j]) + _bf16_f32(m_hi[j])


# --------------------------------------------------------------------------- wrappers


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 (or fp16) tensor as a uint16 numpy view (numba has no bf16 or fp16 arrays)."""
    return t.view(torch.int16).numpy().view(np.uint16)


def _kernel_view(t: torch.Tensor) -> np.ndarray:
    """A bank tensor as the kernels take it: 16-bit floats as uint16 bits, the rest as they are."""
    return bf16_bits(t) if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()


# Packed formats: main tensor suffix and dtype, whether two columns share a byte, and the
# per-group tensors (suffix, dtype) in the order the kernels and dequantisers take them.
_PACKED: dict[str, tuple[str, torch.dtype, bool, tuple[tuple[str, torch.dtype], ...]]] = {
    "int4": (".q", torch.uint8, True, ((".scale", torch.bfloat16), (".min", torch.bfloat16))),
    "q8": (".qs", torch.int8, False, ((".d", torch.float16),)),
    "mxfp4": (".fp4", torch.uint8, True, ((".e8m0", torch.uint8),)),
}
_GROUP = {"int4": _G, "q8": Q8_GROUP_SIZE, "mxfp4": MXFP4_GROUP_SIZE}
_MATMUL_KERNELS = {"fp32": matmul_fp32_kernel, "bf16": matmul_bf16_kernel, "int4": matmul_int4_kernel,
                   "q8": matmul_q8_kernel, "mxfp4": matmul_mxfp4_kernel}
_DEQUANT_KERNELS = {"int4": _dequant_int4, "q8": dequant_q8_kernel, "mxfp4": dequant_mxfp4_kernel}
_DEQUANT_REFERENCE = {"int4": dequantize_int4, "q8": dequantize_q8, "mxfp4": dequantize_mxfp4}


def _expect(t: torch.Tensor, what: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{what}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: must be contiguous")
    if t.device.type != "cpu":
        raise ValueError(f"{what}: must be on the CPU, got {t.device}")


def _matrix(bank_tensors: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor]:
    """Which format ``name`` is stored in, and its main tensor (``W``, ``W.q``, ``W.qs`` or ``W.fp4``)."""
    if name not in MATRIX_NAMES:
        raise ValueError(f"matrix name {name!r} is not one of {MATRIX_NAMES}")
    if name in bank_tensors:
        w = bank_tensors[name]
        if w.dtype == torch.float32:
            return "fp32", w
        if w.dtype == torch.bfloat16:
            return "bf16", w
        raise ValueError(f"bank tensor {name!r} has dtype {w.dtype}; expected float32 or bfloat16")
    for fmt, (suffix, _, _, _) in _PACKED.items():
        if name + suffix in bank_tensors:
            return fmt, bank_tensors[name + suffix]
    keys = ", ".join(repr(name + s) for s in ("", *(p[0] for p in _PACKED.values())))
    raise ValueError(f"bank has none of {keys} (keys: {sorted(bank_tensors)})")


def _packed_tensors(bank_tensors: dict[str, torch.Tensor], fmt: str, name: str) -> list[torch.Tensor]:
    """Main tensor then per-group tensors of a packed matrix, in kernel argument order."""
    suffix, _, _, groups = _PACKED[fmt]
    return [bank_tensors[name + suffix], *(bank_tensors[name + g] for g, _ in groups)]


def check_matrix(bank_tensors: dict[str, torch.Tensor], name: str) -> tuple[str, int, int, int]:
    """Validate bank matrix ``name``; returns ``(format, num_experts, K, N)``."""
    fmt, w = _matrix(bank_tensors, name)
    if w.dim() != 3:
        raise ValueError(f"bank tensor for {name!r} must be 3-D [experts, K, N], got {tuple(w.shape)}")
    experts, k_dim = w.shape[0], w.shape[1]
    if fmt not in _PACKED:
        _expect(w, name, w.dtype, tuple(w.shape))
        return fmt, experts, k_dim, w.shape[2]
    suffix, main_dtype, two_per_byte, groups = _PACKED[fmt]
    n = w.shape[2] * (2 if two_per_byte else 1)
    _expect(w, name + suffix, main_dtype, tuple(w.shape))
    size = _GROUP[fmt]
    if k_dim % size:
        raise ValueError(f"{name}{suffix}: K={k_dim} is not a multiple of the {fmt} group size {size}")
    gshape = (experts, k_dim // size, n)
    for part, dtype in groups:
        key = name + part
        if key not in bank_tensors:
            raise ValueError(f"{fmt} bank lacks {key!r}")
        _expect(bank_tensors[key], key, dtype, gshape)
    return fmt, experts, k_dim, n


def check_x(x: torch.Tensor, k_dim: int, what: str) -> None:
    """``x`` must be a contiguous float32 CPU ``[T, k_dim]``."""
    if x.dim() != 2 or x.shape[1] != k_dim:
        raise ValueError(f"x must be [T, {k_dim}] for {what}, got {tuple(x.shape)}")
    _expect(x, "x", torch.float32, tuple(x.shape))


def matrix_arrays(bank_tensors: dict[str, torch.Tensor], name: str) -> tuple[np.ndarray, ...]:
    """Whole-bank numpy views of matrix ``name`` as the kernels take them (checked by ``check_matrix``).

    fp32: ``(w,)`` float32; bf16: ``(w,)`` uint16 bits; int4: ``(q, scale, min)`` with uint16
    bits; q8: ``(qs, d)`` int8 and uint16 (fp16) bits; mxfp4: ``(fp4, e8m0)`` uint8.
    """
    fmt, w = _matrix(bank_tensors, name)
    if fmt not in _PACKED:
        return (_kernel_view(w),)
    return tuple(_kernel_view(t) for t in _packed_tensors(bank_tensors, fmt, name))


def _check_call(
    bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int, x: torch.Tensor
) -> tuple[str, int, int]:
    """Validate one call; returns ``(format, K, N)``."""
    fmt, experts, k_dim, n = check_matrix(bank_tensors, name)
    if not 0 <= flat_id < experts:
        raise ValueError(f"flat_id {flat_id} out of range for a bank of {experts} experts")
    check_x(x, k_dim, repr(name))
    return fmt, k_dim, n


def _expert_arrays(bank_tensors: dict[str, torch.Tensor], fmt: str, name: str, flat_id: int) -> list[np.ndarray]:
    """One expert's numpy views of matrix ``name``, in kernel argument order."""
    if fmt not in _PACKED:
        return [_kernel_view(bank_tensors[name][flat_id])]
    return [_kernel_view(t[flat_id]) for t in _packed_tensors(bank_tensors, fmt, name)]


def _dense_f32(bank_tensors: dict[str, torch.Tensor], fmt: str, name: str, flat_id: int, n: int) -> torch.Tensor:
    """One expert's matrix as float32 ``[K, N]`` (prefill path)."""
    if fmt == "fp32":
        return bank_tensors[name][flat_id]
    if fmt == "bf16":
        return bank_tensors[name][flat_id].float()
    arrays = _expert_arrays(bank_tensors, fmt, name, flat_id)
    out = torch.empty(arrays[0].shape[0], n, dtype=torch.float32)
    with launch_guard():
        _DEQUANT_KERNELS[fmt](*arrays, out.numpy())
    return out


def _prefill_matmul(bank_tensors: dict[str, torch.Tensor], fmt: str, name: str, flat_id: int, n: int,
                    x: torch.Tensor) -> torch.Tensor:
    """``x @ W`` for many tokens. fp32 banks stay float32. The others multiply in bf16 (the bank's own
    bf16, or the packed weights dequantised and rounded to bf16) with float32 accumulation inside the
    GEMM where this CPU runs bf16 GEMMs natively (4-5x the float32 GEMM on AVX512-BF16 CPUs, at bf16
    rounding of x and of the result: below the weights' own quantisation error, what a bf16
    checkpoint runs at in transformers); elsewhere the weights are widened to float32 (exact) and
    multiplied there (kernels/prefill_gemm.py: torch's bf16 GEMM is ~30x slower on AVX2-only CPUs)."""
    if fmt == "fp32":
        return torch.matmul(x, bank_tensors[name][flat_id])
    if prefill_gemm_dtype(torch.bfloat16, x.device) == torch.float32:
        return torch.matmul(x, _dense_f32(bank_tensors, fmt, name, flat_id, n))
    w = bank_tensors[name][flat_id] if fmt == "bf16" else _dense_f32(bank_tensors, fmt, name, flat_id, n).bfloat16()
    rows = x.shape[0]
    padded = x.new_zeros((-(-rows // PREFILL_ROW_BUCKET) * PREFILL_ROW_BUCKET, x.shape[1]), dtype=torch.bfloat16)
    padded[:rows] = x  # rounded to bf16 on the copy; the zero rows change no other row
    return torch.matmul(padded, w)[:rows].float()


def expert_matmul(bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int, x: torch.Tensor) -> torch.Tensor:
    """``x [T, K] f32 @ W [K, N]`` for expert ``flat_id`` of bank matrix ``name`` -> float32 ``[T, N]``."""
    fmt, k_dim, n = _check_call(bank_tensors, name, flat_id, x)
    ntok = x.shape[0]
    if ntok > DIRECT_MAX_TOKENS:
        return _prefill_matmul(bank_tensors, fmt, name, flat_id, n, x)
    out = torch.empty(ntok, n, dtype=torch.float32)
    if ntok == 0:
        return out
    arrays = _expert_arrays(bank_tensors, fmt, name, flat_id)
    with launch_guard():
        _MATMUL_KERNELS[fmt](x.numpy(), *arrays, numba.get_num_threads(), out.numpy())
    return out


def expert_weight_reference(bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int) -> torch.Tensor:
    """Expert ``flat_id``'s matrix ``name`` as float32 ``[K, N]``, in plain torch."""
    fmt, _ = _matrix(bank_tensors, name)
    if fmt in _PACKED:
        return _DEQUANT_REFERENCE[fmt](*(t[flat_id] for t in _packed_tensors(bank_tensors, fmt, name)))
    return bank_tensors[name][flat_id].float()


def expert_matmul_reference(
    bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int, x: torch.Tensor
) -> torch.Tensor:
    """Plain-torch twin of ``expert_matmul``: dequantize to float32, then ``x @ W``."""
    _check_call(bank_tensors, name, flat_id, x)
    return x @ expert_weight_reference(bank_tensors, name, flat_id)
