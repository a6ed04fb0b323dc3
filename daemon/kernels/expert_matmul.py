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
from numba import prange

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


# --------------------------------------------------------------------------- kernels


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
    part = np.zeros((nparts, ntok, n), np.float32)  # one partial sum per block of K rows
    rows = (k_dim + nparts - 1) // nparts
    for p in prange(nparts):
        acc = part[p]
        for k in range(p * rows, min(k_dim, (p + 1) * rows)):
            wk = w[k]
            for t in range(ntok):
                xv = x[t, k]
                at = acc[t]
                for j in range(n):
                    at[j] += wk[j] * xv
    _reduce_parts(part, out)


@_njit
def _matmul_bf16(x: np.ndarray, w: np.ndarray, nparts: int, out: np.ndarray) -> None:
    # x [T, K] f32, w [K, N] uint16 (bf16 bits), out [T, N] f32
    ntok, k_dim = x.shape
    n = w.shape[1]
    part = np.zeros((nparts, ntok, n), np.float32)
    rows = (k_dim + nparts - 1) // nparts
    for p in prange(nparts):
        acc = part[p]
        bits = np.empty(n, np.uint32)
        row = bits.view(np.float32)  # bf16 is the high half of a float32
        for k in range(p * rows, min(k_dim, (p + 1) * rows)):
            wk = w[k]
            for j in range(n):
                bits[j] = np.uint32(wk[j]) << 16
            for t in range(ntok):
                xv = x[t, k]
                at = acc[t]
                for j in range(n):
                    at[j] += row[j] * xv
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
        acc = part[p]
        sbits = np.empty(n, np.uint32)
        mbits = np.empty(n, np.uint32)
        s = sbits.view(np.float32)
        m = mbits.view(np.float32)
        s_lo, s_hi, m_lo, m_hi = s[:half], s[half:], m[:half], m[half:]
        lo = np.empty(half, np.float32)
        hi = np.empty(half, np.float32)
        for g in range(p * per, min(groups, (p + 1) * per)):
            for j in range(n):
                sbits[j] = np.uint32(scale[g, j]) << 16
                mbits[j] = np.uint32(mn[g, j]) << 16
            for t in range(ntok):
                for j in range(half):
                    lo[j] = 0.0
                    hi[j] = 0.0
                xsum = np.float32(0.0)
                for kk in range(32):
                    k = g * 32 + kk
                    xv = x[t, k]
                    xsum += xv
                    qk = q[k]
                    for j in range(half):
                        b = np.int32(qk[j])
                        lo[j] += np.float32(b & 15) * xv
                        hi[j] += np.float32(b >> 4) * xv
                # Slices, not ``half + j``: indices LLVM can prove non-negative vectorise.
                at_lo = acc[t, :half]
                at_hi = acc[t, half:]
                for j in range(half):
                    at_lo[j] += s_lo[j] * lo[j] + m_lo[j] * xsum
                for j in range(half):
                    at_hi[j] += s_hi[j] * hi[j] + m_hi[j] * xsum
    _reduce_parts(part, out)


@_njit
def _dequant_int4(q: np.ndarray, scale: np.ndarray, mn: np.ndarray, out: np.ndarray) -> None:
    # q [K, N/2] uint8, scale/mn [K/G, N] uint16 -> out [K, N] f32
    k_dim, half = q.shape
    n = 2 * half
    for g in prange(k_dim // 32):
        sbits = np.empty(n, np.uint32)
        mbits = np.empty(n, np.uint32)
        s = sbits.view(np.float32)
        m = mbits.view(np.float32)
        for j in range(n):
            sbits[j] = np.uint32(scale[g, j]) << 16
            mbits[j] = np.uint32(mn[g, j]) << 16
        s_lo, s_hi, m_lo, m_hi = s[:half], s[half:], m[:half], m[half:]
        for k in range(g * 32, g * 32 + 32):
            qk = q[k]
            o_lo = out[k, :half]
            o_hi = out[k, half:]
            for j in range(half):
                b = np.int32(qk[j])
                o_lo[j] = np.float32(b & 15) * s_lo[j] + m_lo[j]
                o_hi[j] = np.float32(b >> 4) * s_hi[j] + m_hi[j]


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
