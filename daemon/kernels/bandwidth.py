"""STREAM-like memory read bandwidth: a parallel numba sum over a buffer much larger than the last-level cache."""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import prange

from moed.kernels.expert_matmul import launch_guard, parallel_njit


@parallel_njit
def read_sum_kernel(a: np.ndarray, nparts: int) -> float:
    # a [n] float32; each thread sums one contiguous block, as the matmul kernels stream theirs
    n = a.shape[0]
    per = (n + nparts - 1) // nparts
    sums = np.zeros(nparts, np.float32)
    for p in prange(nparts):
        # A slice plus range(len) lets LLVM prove indices non-negative (no wraparound test)
        # and vectorise the (fastmath, reassociable) sum.
        block = a[min(n, p * per) : min(n, (p + 1) * per)]
        acc = np.float32(0.0)
        for i in range(block.shape[0]):
            acc += block[i]
        sums[p] = acc
    return sums.sum()


def measure_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth in bytes/s over a ``nbytes`` float32 buffer."""
    if nbytes < 4 * 2**20:
        raise ValueError(f"nbytes={nbytes} is too small to get past the caches (use >= 4 MiB, ideally >> LLC)")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    a = np.ones(nbytes // 4, dtype=np.float32)  # ones: touched, so no page faults while timing
    with launch_guard():
        nparts = numba.get_num_threads()
        read_sum_kernel(a, nparts)  # compile + warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            read_sum_kernel(a, nparts)
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best
