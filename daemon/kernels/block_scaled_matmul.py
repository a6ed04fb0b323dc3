"""numba kernels for the symmetric block-scaled bank formats, q8 and mxfp4: one scale per column per 32 rows of K.

Both are built like the int4 kernel in expert_matmul.py: K is split into one contiguous block
of groups per thread, each group of 32 rows sums ``code * x`` into a per-column partial sum in
long contiguous (vectorised) loops over the columns, and the group's scale is applied once.

- q8 (``qs`` int8 ``[K, N]``, ``d`` fp16 bits ``[K/32, N]``): int8 -> float32 is one
  ``sitofp`` per lane; the fp16 scale is widened by ``fpext half -> float`` (exact, subnormals
  included; ``vcvtph2ps`` on x86).
- mxfp4 (``fp4`` uint8 ``[K, N/2]``, ``e8m0`` uint8 ``[K/32, N]``): no table gather. An E2M1
  code's three magnitude bits are exactly an fp16 exponent (2 bits) and top mantissa bit when
  placed at bits 9..11, with E2M1's 0 / 0.5 landing on fp16's zero / subnormal, so
  ``fpext(half(code bits))`` is the E2M1 value times ``2**-14`` (shift, mask, or, convert). The
  ``2**14`` is folded into ``x`` (exact, a power of two) and the e8m0 scale ``2**(e - 127)`` is
  built from its bits once per group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from moed.kernels.numba_runtime import parallel_njit, reduce_parts, serial_njit

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F16 = ir.HalfType()
_F32 = ir.FloatType()
E2M1_UNSCALE = 16384.0  # 2**14: what the fp16 placement of an E2M1 code divides its value by


# --------------------------------------------------------------------------- scalar conversions


@intrinsic
def f16_f32(typingctx: Any, bits: types.Type) -> Any:
    """fp16 bits (any integer type, low 16 bits used) -> float32, exactly."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        v = args[0]
        width = v.type.width
        v16 = builder.trunc(v, _I16) if width > 16 else builder.zext(v, _I16) if width < 16 else v
        return builder.fpext(builder.bitcast(v16, _F16), _F32)

    return types.float32(bits), codegen


@intrinsic
def i8_f32(typingctx: Any, q: types.Type) -> Any:
    """int8 -> float32 on 8-bit lanes (numba would widen to int64 first)."""
    if q != types.int8:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        return builder.sitofp(args[0], _F32)

    return types.float32(q), codegen


@intrinsic
def e8m0_f32(typingctx: Any, e: types.Type) -> Any:
    """uint8 e8m0 exponent -> float32 ``2**(e - 127)`` (``e = 0``: the subnormal ``2**-127``)."""
    if e != types.uint8:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
        v = builder.zext(args[0], _I32)
        is_zero = builder.icmp_unsigned("==", v, ir.Constant(_I32, 0))
        bits = builder.select(is_zero, ir.Constant(_I32, 1 << 22), builder.shl(v, ir.Constant(_I32, 23)))
        return builder.bitcast(bits, _F32)

    return types.float32(e), codegen


def _e2m1_intrinsic(shift: int) -> Any:
    """uint8 -> ``e2m1(nibble) * 2**-14`` as float32, the nibble at bits ``[shift, shift + 4)``.

    Magnitude bits (exponent e1 e0, mantissa m) go to fp16 bits 9..11, the sign to bit 15.
    """

    @intrinsic
    def e2m1(typingctx: Any, b: types.Type) -> Any:
        if b != types.uint8:
            return None

        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> ir.Value:
            v = builder.zext(args[0], _I16)
            mag = builder.and_(v, ir.Constant(_I16, 0x7 << shift))
            sign = builder.and_(v, ir.Constant(_I16, 0x8 << shift))
            mag = builder.shl(mag, ir.Constant(_I16, 9 - shift))
            sign = builder.shl(sign, ir.Constant(_I16, 12 - shift))
            h = builder.or_(mag, sign)
            return builder.fpext(builder.bitcast(h, _F16), _F32)

        return types.float32(b), codegen

    return e2m1


e2m1_lo = _e2m1_intrinsic(0)
e2m1_hi = _e2m1_intrinsic(4)


# --------------------------------------------------------------------------- q8


@serial_njit
def acc_q8(
    x: np.ndarray, xk0: int, qs: np.ndarray, d: np.ndarray, g0: int, g1: int, c0: int, acc: np.ndarray
) -> None:
    # Groups [g0, g1) (rows [32 g0, 32 g1)) of qs [K, N] int8 and d [K/32, N] uint16 (fp16 bits),
    # columns [c0, c0 + nc): acc [T, nc] += x[:, xk0 : xk0 + 32 (g1 - g0)] @ w. Per group and
    # token, part collects sum_k qs_k x_k; the scale d multiplies it once.
    ntok, nc = acc.shape
    part = np.empty((ntok, nc), np.float32)
    for g in range(g0, g1):
        k = g * 32
        xk = xk0 + k - g0 * 32
        for kk in range(0, 32, 4):
            q0 = qs[k + kk, c0 : c0 + nc]
            q1 = qs[k + kk + 1, c0 : c0 + nc]
            q2 = qs[k + kk + 2, c0 : c0 + nc]
            q3 = qs[k + kk + 3, c0 : c0 + nc]
            for t in range(ntok):
                x0 = x[t, xk + kk]
                x1 = x[t, xk + kk + 1]
                x2 = x[t, xk + kk + 2]
                x3 = x[t, xk + kk + 3]
                pt = part[t]
                if kk == 0:  # first rows of the group: set, do not add
                    for j in range(nc):
                        pt[j] = (i8_f32(q0[j]) * x0 + i8_f32(q1[j]) * x1) + (i8_f32(q2[j]) * x2 + i8_f32(q3[j]) * x3)
                else:
                    for j in range(nc):
                        pt[j] += (i8_f32(q0[j]) * x0 + i8_f32(q1[j]) * x1) + (i8_f32(q2[j]) * x2 + i8_f32(q3[j]) * x3)
        dg = d[g, c0 : c0 + nc]
        for t in range(ntok):
            pt = part[t]
            at = acc[t]
            for j in range(nc):
                at[j] += f16_f32(dg[j]) * pt[j]


@parallel_njit
def matmul_q8_kernel(x: np.ndarray, qs: np.ndarray, d: np.ndarray, nparts: int, out: np.ndarray) -> None:
    # x [T, K] f32, qs [K, N] int8, d [K/32, N] uint16 (fp16 bits), out [T, N] f32
    groups = x.shape[1] // 32
    part = np.zeros((nparts, x.shape[0], qs.shape[1]), np.float32)
    per = (groups + nparts - 1) // nparts
    for p in prange(nparts):
        g0 = min(groups, p * per)
        g1 = min(groups, g0 + per)
        acc_q8(x, g0 * 32, qs, d, g0, g1, 0, part[p])
    reduce_parts(part, out)


@parallel_njit
def dequant_q8_kernel(qs: np.ndarray, d: np.ndarray, out: np.ndarray) -> None:
    # qs [K, N] int8, d [K/32, N] uint16 -> out [K, N] f32 (exact)
    k_dim, n = qs.shape
    for g in prange(k_dim // 32):
        dg = d[g]
        for k in range(g * 32, g * 32 + 32):
            qk = qs[k]
            ok = out[k]
            for j in range(n):
                ok[j] = i8_f32(qk[j]) * f16_f32(dg[j])


# --------------------------------------------------------------------------- mxfp4


@serial_njit
def acc_mxfp4(
    x: np.ndarray, xk0: int, fp4: np.ndarray, e8: np.ndarray, g0: int, g1: int, b0: int, acc: np.ndarray
) -> None:
    # Groups [g0, g1) of fp4 [K, N/2] uint8 and e8 [K/32, N] uint8, bytes [b0, b0 + nb):
    # acc [T, 2 nb] += columns [b0, b0 + nb) (low nibbles) then N/2 + [b0, b0 + nb) (high
    # nibbles), as acc_int4 lays them out. lo/hi collect sum_k e2m1(code_k) 2**-14 * (2**14 x_k).
    ntok = acc.shape[0]
    nb = acc.shape[1] // 2
    half = fp4.shape[1]
    lo = np.empty((ntok, nb), np.float32)
    hi = np.empty((ntok, nb), np.float32)
    unscale = np.float32(E2M1_UNSCALE)
    for g in range(g0, g1):
        k = g * 32
        xk = xk0 + k - g0 * 32
        for kk in range(0, 32, 4):
            q0 = fp4[k + kk, b0 : b0 + nb]
            q1 = fp4[k + kk + 1, b0 : b0 + nb]
            q2 = fp4[k + kk + 2, b0 : b0 + nb]
            q3 = fp4[k + kk + 3, b0 : b0 + nb]
            for t in range(ntok):
                x0 = x[t, xk + kk] * unscale
                x1 = x[t, xk + kk + 1] * unscale
                x2 = x[t, xk + kk + 2] * unscale
                x3 = x[t, xk + kk + 3] * unscale
                lt = lo[t]
                ht = hi[t]
                if kk == 0:
                    for j in range(nb):
                        e0 = q0[j]
                        e1 = q1[j]
                        e2 = q2[j]
                        e3 = q3[j]
                        lt[j] = (e2m1_lo(e0) * x0 + e2m1_lo(e1) * x1) + (e2m1_lo(e2) * x2 + e2m1_lo(e3) * x3)
                        ht[j] = (e2m1_hi(e0) * x0 + e2m1_hi(e1) * x1) + (e2m1_hi(e2) * x2 + e2m1_hi(e3) * x3)
                else:
                    for j in range(nb):
                        e0 = q0[j]
                        e1 = q1[j]
                        e2 = q2[j]
                        e3 = q3[j]
                        lt[j] += (e2m1_lo(e0) * x0 + e2m1_lo(e1) * x1) + (e2m1_lo(e2) * x2 + e2m1_lo(e3) * x3)
                        ht[j] += (e2m1_hi(e0) * x0 + e2m1_hi(e1) * x1) + (e2m1_hi(e2) * x2 + e2m1_hi(e3) * x3)
        s_lo = e8[g, b0 : b0 + nb]
        s_hi = e8[g, half + b0 : half + b0 + nb]
        for t in range(ntok):
            lt = lo[t]
            ht = hi[t]
            a_lo = acc[t, :nb]
            a_hi = acc[t, nb:]
            for j in range(nb):
                a_lo[j] += e8m0_f32(s_lo[j]) * lt[j]
            for j in range(nb):
                a_hi[j] += e8m0_f32(s_hi[j]) * ht[j]


@parallel_njit
def matmul_mxfp4_kernel(x: np.ndarray, fp4: np.ndarray, e8: np.ndarray, nparts: int, out: np.ndarray) -> None:
    # x [T, K] f32, fp4 [K, N/2] uint8, e8 [K/32, N] uint8, out [T, N] f32
    groups = x.shape[1] // 32
    half = fp4.shape[1]
    part = np.zeros((nparts, x.shape[0], 2 * half), np.float32)
    per = (groups + nparts - 1) // nparts
    for p in prange(nparts):
        g0 = min(groups, p * per)
        g1 = min(groups, g0 + per)
        acc_mxfp4(x, g0 * 32, fp4, e8, g0, g1, 0, part[p])
    reduce_parts(part, out)


@parallel_njit
def dequant_mxfp4_kernel(fp4: np.ndarray, e8: np.ndarray, out: np.ndarray) -> None:
    # fp4 [K, N/2] uint8, e8 [K/32, N] uint8 -> out [K, N] f32
    k_dim, half = fp4.shape
    unscale = np.float32(E2M1_UNSCALE)
    for g in prange(k_dim // 32):
        eg = e8[g]
        e_lo, e_hi = eg[:half], eg[half:]
        for k in range(g * 32, g * 32 + 32):
            bk = fp4[k]
            o_lo = out[k, :half]
            o_hi = out[k, half:]
            for j in range(half):
                o_lo[j] = (e2m1_lo(bk[j]) * unscale) * e8m0_f32(e_lo[j])
            for j in range(half):
                o_hi[j] = (e2m1_hi(bk[j]) * unscale) * e8m0_f32(e_hi[j])
