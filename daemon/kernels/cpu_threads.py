"""How many CPU threads moed's kernels use: decided here, once, for all of them.

The native kernels' pool, numba and torch's intra-op pool each get one thread per usable core
(the process's CPU affinity, so `taskset` and cgroup cpusets are honoured), never more: two
pools of 2 threads on 2 cores would fight. They do not run at the same time: at decode the
native pool runs the expert and projection kernels while torch's threads sleep (GOMP_SPINCOUNT
is kept short in moed/__init__.py), and the pool's own threads spin only ~30 us before sleeping
(MOED_SPIN_US). ``MOED_CPU_THREADS`` overrides the count for all three; the libraries' own
variables (``NUMBA_NUM_THREADS``, ``OMP_NUM_THREADS``) still win for that library.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_threads() -> int:
    """Threads for each of the kernel pools: ``MOED_CPU_THREADS`` or one per usable core."""
    value = os.environ.get("MOED_CPU_THREADS", "").strip()
    if value:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"MOED_CPU_THREADS={value!r} must be a whole number of threads") from None
        if n < 1:
            raise ValueError(f"MOED_CPU_THREADS={value!r} must be at least 1")
        return n
    return usable_cores()
