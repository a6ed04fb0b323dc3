"""numba setup shared by the CPU kernels: jit decorators, thread count, the launch guard, the partial-sum reduction.

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

from moed.kernels.cpu_threads import cpu_threads


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


_layer_lock = threading.Lock()
_launch_lock: contextlib.AbstractContextManager[Any] = threading.Lock()  # until the layer is known
_layer: str | None = None


def configure_threads(num_threads: int | None = None) -> None:
    """Set numba (for the calling thread) and torch to ``num_threads``, default one per usable core.

    Runs with no argument when this module is imported; an explicit ``NUMBA_NUM_THREADS`` /
    ``OMP_NUM_THREADS`` in the environment then wins for that library.
    """
    n = num_threads or cpu_threads()
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


# --------------------------------------------------------------------------- partial sums


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
