"""CPU matmul ``y[T, N] = x[T, K] @ W[K, N]`` of one bank expert (fp32 / bf16 / int4), numba kernels plus torch reference.

Decode (``T <= DIRECT_MAX_TOKENS``) runs numba kernels that read each weight byte once per
call: the reduction dimension K is split into one contiguous block of rows per thread (each
thread streams its own part of the matrix front to back, into its own partial sum), and every
group of four rows feeds one long contiguous loop over the output columns, which LLVM
vectorises (AVX-512 here). bf16 is widened by a shift and a bitcast; int4 nibbles become the
float ``1 + q/16`` by placing them in the mantissa (no int->float conversion), and scale/min
are applied once per group of 32 rows. Prefill (more tokens) converts the matrix to float32
and lets ``torch.matmul`` do a GEMM.

Accuracy contract (checked by tests/kernels/test_expert_matmul.py): elementwise
``|y - y_ref| <= MATMUL_RTOL * (|x| @ A)`` with ``MATMUL_RTOL = 1e-5``, where ``y_ref`` is
``expert_matmul_reference`` (weights dequantized to float32, then ``torch.matmul``), ``A = |W|``
for fp32/bf16 and ``A = (q + 16) * |scale| + |min|`` for int4. Only the float32 summation order
differs (observed: < 1e-6 of the bound): the int4 kernel sums ``(1 + q/16) * x`` over each
group of 32 and applies ``scale`` and ``min`` once per group, hence the ``16 * |scale|`` term.

Threads: numba and torch use one thread per core by default (``configure_threads``). numba's
``workqueue`` threading layer is not safe for parallel kernels launched from several Python
threads at once; numba prefers ``tbb`` then ``omp`` when present, and only when it falls back
to ``workqueue`` are the calls serialised with a lock. Kernels release the GIL.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Callable

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from moed.kernels.int4_format import INT4_GROUP_SIZE, dequantize_int4

MATMUL_RTOL = 1e-5
DIRECT_MAX_TOKENS = 16  # above this, convert to float32 and use torch.matmul
MATRIX_NAMES = ("gate_up", "down")
_G = INT4_GROUP_SIZE


# --------------------------------------------------------------------------- numba setup


def _jit(fn: Callable[..., Any], parallel: bool) -> Any:
    opts = dict(parallel=parallel, fastmath=True, nogil=True)
    try:
        return numba.njit(cache=True, **opts)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(cache=False, **opts)(fn)


def parallel_njit(fn: Callable[..., Any]) -> Any:
    """``njit(parallel, fastmath, nogil, cache)``; without a writable cache location, no cache."""
    return _jit(fn, parallel=True)


def serial_njit(fn: Callable[..., Any]) -> Any:
    """As ``parallel_njit`` without ``parallel``: helpers and callers of the parallel kernels."""
    return _jit(fn, parallel=False)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_layer_lock = threading.Lock()
_launch_lock: contextlib.AbstractContextManager[Any] = threading.Lock()  # until the layer is known
_layer: str | None = None


def configure_threads(num_threads: int | None = None) -> None:
    """Set numba (for the calling thread) and torch to ``num_threads``, default one per usable core.

    Runs with no argument when this module is imported; an explicit ``NUMBA_NUM_THREADS`` /
    ``OMP_NUM_THREADS`` in the environment then wins for that library.
    """
    n = num_threads or _cpu_count()
    if num_threads is not None or "NUMBA_NUM_THREADS" not in os.environ:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    if num_threads is not None or "OMP_NUM_THREADS" not in os.environ:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


def threading_layer() -> str:
    """numba's threading layer, starting numba's thread pool if needed (tbb, then omp, then workqueue)."""
    global _layer, _launch_lock
    with _layer_lock:
        if _layer is None:
            layer = "unknown"
            try:
                from numba.np.ufunc.parallel import _launch_threads

                _launch_threads()
                layer = numba.threading_layer()
            except Exception as exc:  # keep working, serialised
                warnings.warn(f"could not determine numba's threading layer ({exc}); serialising kernels")
            # Only tbb and omp take concurrent launches; workqueue aborts the process.
            _launch_lock = contextlib.nullcontext() if layer in ("tbb", "omp") else threading.Lock()
            _layer = layer
        return _layer


def launch_guard() -> contextlib.AbstractContextManager[Any]:
    """Context for launching a parallel kernel: a lock only where the threading layer needs one."""
    if _layer is None:
        threading_layer()
    return _launch_lock


configure_threads()


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
def reduce_parts(part: np.ndarray, out: np.ndarray) -> None:
    # part [P, T, N] -> out [T, N]
    nparts, ntok, n = part.shape
    for t in range(ntok):
        o = out[t]
        p0 = part[0, t]
        for j in range(n):
            o[j] = p0[j]
        for p in range(1, nparts):
            pt = part[p, t]
            for j in range(n):
                o[j] += pt[j]


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
    """A bf16 tensor as a uint16 numpy view (numba has no bf16 or fp16 arrays)."""
    return t.view(torch.int16).numpy().view(np.uint16)


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
    """Which format ``name`` is stored in, and its main tensor (``W`` or ``W.q``)."""
    if name not in MATRIX_NAMES:
        raise ValueError(f"matrix name {name!r} is not one of {MATRIX_NAMES}")
    if name in bank_tensors:
        w = bank_tensors[name]
        if w.dtype == torch.float32:
            return "fp32", w
        if w.dtype == torch.bfloat16:
            return "bf16", w
        raise ValueError(f"bank tensor {name!r} has dtype {w.dtype}; expected float32 or bfloat16")
    if name + ".q" in bank_tensors:
        return "int4", bank_tensors[name + ".q"]
    raise ValueError(f"bank has no {name!r} nor {name + '.q'!r} (keys: {sorted(bank_tensors)})")


def check_matrix(bank_tensors: dict[str, torch.Tensor], name: str) -> tuple[str, int, int, int]:
    """Validate bank matrix ``name``; returns ``(format, num_experts, K, N)``."""
    fmt, w = _matrix(bank_tensors, name)
    if w.dim() != 3:
        raise ValueError(f"bank tensor for {name!r} must be 3-D [experts, K, N], got {tuple(w.shape)}")
    experts, k_dim = w.shape[0], w.shape[1]
    n = w.shape[2] * (2 if fmt == "int4" else 1)
    if fmt == "int4":
        _expect(w, f"{name}.q", torch.uint8, tuple(w.shape))
        if k_dim % _G:
            raise ValueError(f"{name}.q: K={k_dim} is not a multiple of {_G}")
        gshape = (experts, k_dim // _G, n)
        for part in ("scale", "min"):
            key = f"{name}.{part}"
            if key not in bank_tensors:
                raise ValueError(f"int4 bank lacks {key!r}")
            _expect(bank_tensors[key], key, torch.bfloat16, gshape)
    else:
        _expect(w, name, w.dtype, tuple(w.shape))
    return fmt, experts, k_dim, n


def check_x(x: torch.Tensor, k_dim: int, what: str) -> None:
    """``x`` must be a contiguous float32 CPU ``[T, k_dim]``."""
    if x.dim() != 2 or x.shape[1] != k_dim:
        raise ValueError(f"x must be [T, {k_dim}] for {what}, got {tuple(x.shape)}")
    _expect(x, "x", torch.float32, tuple(x.shape))


def matrix_arrays(bank_tensors: dict[str, torch.Tensor], name: str) -> tuple[np.ndarray, ...]:
    """Whole-bank numpy views of matrix ``name`` as the kernels take them (checked by ``check_matrix``).

    fp32: ``(w,)`` float32; bf16: ``(w,)`` uint16 bits; int4: ``(q, scale, min)`` with uint16 bits.
    """
    fmt, _ = _matrix(bank_tensors, name)
    if fmt == "fp32":
        return (bank_tensors[name].numpy(),)
    if fmt == "bf16":
        return (bf16_bits(bank_tensors[name]),)
    return (
        bank_tensors[name + ".q"].numpy(),
        bf16_bits(bank_tensors[name + ".scale"]),
        bf16_bits(bank_tensors[name + ".min"]),
    )


def _check_call(
    bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int, x: torch.Tensor
) -> tuple[str, int, int]:
    """Validate one call; returns ``(format, K, N)``."""
    fmt, experts, k_dim, n = check_matrix(bank_tensors, name)
    if not 0 <= flat_id < experts:
        raise ValueError(f"flat_id {flat_id} out of range for a bank of {experts} experts")
    check_x(x, k_dim, repr(name))
    return fmt, k_dim, n


def _dense_f32(bank_tensors: dict[str, torch.Tensor], fmt: str, name: str, flat_id: int) -> torch.Tensor:
    """One expert's matrix as float32 ``[K, N]`` (prefill path)."""
    if fmt == "fp32":
        return bank_tensors[name][flat_id]
    if fmt == "bf16":
        return bank_tensors[name][flat_id].float()
    q = bank_tensors[name + ".q"][flat_id]
    out = torch.empty(q.shape[0], q.shape[1] * 2, dtype=torch.float32)
    with launch_guard():
        _dequant_int4(
            q.numpy(),
            bf16_bits(bank_tensors[name + ".scale"][flat_id]),
            bf16_bits(bank_tensors[name + ".min"][flat_id]),
            out.numpy(),
        )
    return out


def expert_matmul(bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int, x: torch.Tensor) -> torch.Tensor:
    """``x [T, K] f32 @ W [K, N]`` for expert ``flat_id`` of bank matrix ``name`` -> float32 ``[T, N]``."""
    fmt, k_dim, n = _check_call(bank_tensors, name, flat_id, x)
    ntok = x.shape[0]
    if ntok > DIRECT_MAX_TOKENS:
        return torch.matmul(x, _dense_f32(bank_tensors, fmt, name, flat_id))
    out = torch.empty(ntok, n, dtype=torch.float32)
    if ntok == 0:
        return out
    xn, on = x.numpy(), out.numpy()
    with launch_guard():
        nparts = numba.get_num_threads()
        if fmt == "fp32":
            matmul_fp32_kernel(xn, bank_tensors[name][flat_id].numpy(), nparts, on)
        elif fmt == "bf16":
            matmul_bf16_kernel(xn, bf16_bits(bank_tensors[name][flat_id]), nparts, on)
        else:
            matmul_int4_kernel(
                xn,
                bank_tensors[name + ".q"][flat_id].numpy(),
                bf16_bits(bank_tensors[name + ".scale"][flat_id]),
                bf16_bits(bank_tensors[name + ".min"][flat_id]),
                nparts,
                on,
            )
    return out


def expert_weight_reference(bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int) -> torch.Tensor:
    """Expert ``flat_id``'s matrix ``name`` as float32 ``[K, N]``, in plain torch."""
    fmt, _ = _matrix(bank_tensors, name)
    if fmt == "int4":
        return dequantize_int4(
            bank_tensors[name + ".q"][flat_id],
            bank_tensors[name + ".scale"][flat_id],
            bank_tensors[name + ".min"][flat_id],
        )
    return bank_tensors[name][flat_id].float()


def expert_matmul_reference(
    bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int, x: torch.Tensor
) -> torch.Tensor:
    """Plain-torch twin of ``expert_matmul``: dequantize to float32, then ``x @ W``."""
    _check_call(bank_tensors, name, flat_id, x)
    return x @ expert_weight_reference(bank_tensors, name, flat_id)
