"""CpuWorkerPool: a persistent worker that runs the CPU branch of an MoE layer concurrently.

The branch is launched first so it gets a head start on DRAM; numba kernels release the GIL, so
the device branch (copies, device compute) proceeds on the calling thread meanwhile.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class CpuWorkerPool:
    def __init__(self, num_kernel_threads: int | None = None) -> None:
        """``num_kernel_threads``: numba threads the CPU branch may use (None = numba's default)."""
        self.num_kernel_threads = num_kernel_threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moed-cpu-experts",
                                        initializer=self._init_worker)

    def _init_worker(self) -> None:
        if self.num_kernel_threads:
            import numba  # numba's thread count is per calling thread

            numba.set_num_threads(self.num_kernel_threads)

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
