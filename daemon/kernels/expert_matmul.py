"""CPU matmul ``y[T, N] = x[T, K] @ W[K, N]`` of one bank expert (fp32 / bf16 / int4), numba kernels plus torch reference.

Decode (``T <= DIRECT_MAX_TOKENS``) runs numba kernels that read each weight byte once per
call and are memory-bandwidth bound: the reduction dimension K is split into one contiguous
block of rows per thread (each thread streams its own part of the matrix front to back), and
every row feeds one long contiguous loop over the output columns, which LLVM vectorises.
Prefill (more tokens) converts the matrix to float32 and lets ``torch.matmul`` do a GEMM.

Accuracy contract (checked by tests/kernels/test_expert_matmul.py): elementwise
``|y - y_ref| <= MATMUL_RTOL * (|x| @ A)`` where ``y_ref`` is ``expert_matmul_reference`` (the
weights dequantized to float32, then ``torch.matmul``), ``A = |W|`` for fp32/bf16 and
``A = |q * scale| + |min|`` for int4. Only the float32 summation order differs: the int4
kernel sums ``q * x`` over each group of 32 and applies ``scale`` and ``min * sum(x)`` once
per group, so the bound is in terms of ``A`` rather than ``|W|``.

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

from moed.cache.host_bank import INT4_GROUP_SIZE
from moed.kernels.int4_format import dequantize_int4

MATMUL_RTOL = 3e-5
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


def _njit(fn: Callable[..., Any]) -> Any:
    """``njit(parallel, fastmath, nogil, cache)``; without a writable cache location, no cache."""
    return _jit(fn, parallel=True)


def _njit_serial(fn: Callable[..., Any]) -> Any:
    """As ``_njit`` for helpers that run inside or after a parallel region."""
    return _jit(fn, parallel=False)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


_config_lock = threading.Lock()
_launch_lock: contextlib.AbstractContextManager[Any] = threading.Lock()  # until we know
_configured = False


def configure_threads(num_threads: int | None = None) -> str:
    """Set numba and torch to ``num_threads`` (default: one per usable core); returns numba's threading layer.

    An explicit ``NUMBA_NUM_THREADS`` / ``OMP_NUM_THREADS`` in the environment wins over the
    default for that library. Called once, lazily, by the first kernel call.
    """
    global _configured, _launch_lock
    with _config_lock:
        n = num_threads or _cpu_count()
        if num_threads is not None or "NUMBA_NUM_THREADS" not in os.environ:
            numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
        if num_threads is not None or "OMP_NUM_THREADS" not in os.environ:
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
        layer = "unknown"
        try:
            from numba.np.ufunc.parallel import _launch_threads

            _launch_threads()  # picks the layer: tbb, then omp, then workqueue
            layer = numba.threading_layer()
        except Exception as exc:  # keep working, serialised
            warnings.warn(f"could not determine numba's threading layer ({exc}); serialising kernels")
        _launch_lock = threading.Lock() if layer not in ("tbb", "omp") else contextlib.nullcontext()
        _configured = True
        return layer


def _guard() -> contextlib.AbstractContextManager[Any]:
    if not _configured:
        configure_threads()
    return _launch_lock


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
# Shared shape: ``prange`` over ``nparts`` contiguous blocks of K rows (one per thread), each
# accumulating into its own ``part[p]`` [T, N]; ``_reduce_parts`` sums them. Rows go two at a
# time so every accumulator load/store serves two weights. Loops index 1-D slices with
# ``range`` indices, which LLVM can prove non-negative (no wraparound test), so they vectorise.


@_njit_serial
def _reduce_parts(part: np.ndarray, out: np.ndarray) -> None:
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


@_njit
def _matmul_f32(x: np.ndarray, w: np.ndarray, nparts: int, out: np.ndarray) -> None:
    # x [T, K] f32, w [K, N] f32, out [T, N] f32
    ntok, k_dim = x.shape
    n = w.shape[1]
    part = np.zeros((nparts, ntok, n), np.float32)
    rows = (k_dim + nparts - 1) // nparts
    rows += rows % 2
    for p in prange(nparts):
        k0 = min(k_dim, p * rows)
        k1 = min(k_dim, k0 + rows)
        for k in range(k0, k1 - 1, 2):
            w0 = w[k]
            w1 = w[k + 1]
            for t in range(ntok):
                x0 = x[t, k]
                x1 = x[t, k + 1]
                at = part[p, t]
                for j in range(n):
                    at[j] += w0[j] * x0 + w1[j] * x1
        if (k1 - k0) % 2:
            w0 = w[k1 - 1]
            for t in range(ntok):
                x0 = x[t, k1 - 1]
                at = part[p, t]
                for j in range(n):
                    at[j] += w0[j] * x0
    _reduce_parts(part, out)


@_njit
def _matmul_bf16(x: np.ndarray, w: np.ndarray, nparts: int, out: np.ndarray) -> None:
    # x [T, K] f32, w [K, N] uint16 (bf16 bits), out [T, N] f32
    ntok, k_dim = x.shape
    n = w.shape[1]
    part = np.zeros((nparts, ntok, n), np.float32)
    rows = (k_dim + nparts - 1) // nparts
    rows += rows % 2
    for p in prange(nparts):
        k0 = min(k_dim, p * rows)
        k1 = min(k_dim, k0 + rows)
        for k in range(k0, k1 - 1, 2):
            w0 = w[k]
            w1 = w[k + 1]
            for t in range(ntok):
                x0 = x[t, k]
                x1 = x[t, k + 1]
                at = part[p, t]
                for j in range(n):
                    at[j] += _bf16_f32(w0[j]) * x0 + _bf16_f32(w1[j]) * x1
        if (k1 - k0) % 2:
            w0 = w[k1 - 1]
            for t in range(ntok):
                x0 = x[t, k1 - 1]
                at = part[p, t]
                for j in range(n):
                    at[j] += _bf16_f32(w0[j]) * x0
    _reduce_parts(part, out)


@_njit
def _matmul_int4(
    x: np.ndarray, q: np.ndarray, scale: np.ndarray, mn: np.ndarray, nparts: int, out: np.ndarray
) -> None:
    # x [T, K] f32, q [K, N/2] uint8, scale/mn [K/G, N] uint16 (bf16 bits), out [T, N] f32
    ntok, k_dim = x.shape
    half = q.shape[1]
    n = 2 * half
    groups = k_dim // 32
    part = np.zeros((nparts, ntok, n), np.float32)
    per = (groups + nparts - 1) // nparts
    for p in prange(nparts):
        # Per group and token, lo/hi collect sum_k (1 + q/16) x_k; with xsum = sum_k x_k,
        # sum_k w x = scale * sum_k q x + min * xsum = 16 scale * lo + (min - 16 scale) * xsum.
        lo = np.empty((ntok, half), np.float32)  # low nibbles: columns [0, N/2)
        hi = np.empty((ntok, half), np.float32)  # high nibbles: columns [N/2, N)
        xsum = np.empty(ntok, np.float32)
        s16 = np.empty(n, np.float32)
        off = np.empty(n, np.float32)
        for g in range(min(groups, p * per), min(groups, (p + 1) * per)):
            k = g * 32
            q0 = q[k]
            q1 = q[k + 1]
            for t in range(ntok):
                x0 = x[t, k]
                x1 = x[t, k + 1]
                xsum[t] = x0 + x1
                lt = lo[t]
                ht = hi[t]
                for j in range(half):
                    lt[j] = _nib_lo(q0[j]) * x0 + _nib_lo(q1[j]) * x1
                    ht[j] = _nib_hi(q0[j]) * x0 + _nib_hi(q1[j]) * x1
            for k in range(g * 32 + 2, g * 32 + 32, 2):
                q0 = q[k]
                q1 = q[k + 1]
                for t in range(ntok):
                    x0 = x[t, k]
                    x1 = x[t, k + 1]
                    xsum[t] += x0 + x1
                    lt = lo[t]
                    ht = hi[t]
                    for j in range(half):
                        lt[j] += _nib_lo(q0[j]) * x0 + _nib_lo(q1[j]) * x1
                        ht[j] += _nib_hi(q0[j]) * x0 + _nib_hi(q1[j]) * x1
            sg = scale[g]
            mg = mn[g]
            for j in range(n):
                sj = _bf16_f32(sg[j]) * np.float32(16.0)
                s16[j] = sj
                off[j] = _bf16_f32(mg[j]) - sj
            s16_lo, s16_hi, off_lo, off_hi = s16[:half], s16[half:], off[:half], off[half:]
            for t in range(ntok):
                xs = xsum[t]
                lt = lo[t]
                ht = hi[t]
                at_lo = part[p, t, :half]
                at_hi = part[p, t, half:]
                for j in range(half):
                    at_lo[j] += s16_lo[j] * lt[j] + off_lo[j] * xs
                for j in range(half):
                    at_hi[j] += s16_hi[j] * ht[j] + off_hi[j] * xs
    _reduce_parts(part, out)


@_njit
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


def _bits(t: torch.Tensor) -> np.ndarray:
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


def _check_call(
    bank_tensors: dict[str, torch.Tensor], name: str, flat_id: int, x: torch.Tensor
) -> tuple[str, int, int]:
    """Validate one call; returns ``(format, K, N)``."""
    fmt, w = _matrix(bank_tensors, name)
    if w.dim() != 3:
        raise ValueError(f"bank tensor for {name!r} must be 3-D [experts, K, N], got {tuple(w.shape)}")
    k_dim = w.shape[1]
    n = w.shape[2] * (2 if fmt == "int4" else 1)
    if not 0 <= flat_id < w.shape[0]:
        raise ValueError(f"flat_id {flat_id} out of range for a bank of {w.shape[0]} experts")
    if fmt == "int4":
        _expect(w, f"{name}.q", torch.uint8, tuple(w.shape))
        if k_dim % _G:
            raise ValueError(f"{name}.q: K={k_dim} is not a multiple of {_G}")
        gshape = (w.shape[0], k_dim // _G, n)
        for part in ("scale", "min"):
            key = f"{name}.{part}"
            if key not in bank_tensors:
                raise ValueError(f"int4 bank lacks {key!r}")
            _expect(bank_tensors[key], key, torch.bfloat16, gshape)
    else:
        _expect(w, name, w.dtype, tuple(w.shape))
    if x.dim() != 2 or x.shape[1] != k_dim:
        raise ValueError(f"x must be [T, {k_dim}] for {name!r}, got {tuple(x.shape)}")
    _expect(x, "x", torch.float32, tuple(x.shape))
    return fmt, k_dim, n


def _dense_f32(bank_tensors: dict[str, torch.Tensor], fmt: str, name: str, flat_id: int) -> torch.Tensor:
    """One expert's matrix as float32 ``[K, N]`` (prefill path)."""
    if fmt == "fp32":
        return bank_tensors[name][flat_id]
    if fmt == "bf16":
        return bank_tensors[name][flat_id].float()
    q = bank_tensors[name + ".q"][flat_id]
    out = torch.empty(q.shape[0], q.shape[1] * 2, dtype=torch.float32)
    with _guard():
        _dequant_int4(
            q.numpy(),
            _bits(bank_tensors[name + ".scale"][flat_id]),
            _bits(bank_tensors[name + ".min"][flat_id]),
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
    with _guard():
        nparts = numba.get_num_threads()
        if fmt == "fp32":
            _matmul_f32(xn, bank_tensors[name][flat_id].numpy(), nparts, on)
        elif fmt == "bf16":
            _matmul_bf16(xn, _bits(bank_tensors[name][flat_id]), nparts, on)
        else:
            _matmul_int4(
                xn,
                bank_tensors[name + ".q"][flat_id].numpy(),
                _bits(bank_tensors[name + ".scale"][flat_id]),
                _bits(bank_tensors[name + ".min"][flat_id]),
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
