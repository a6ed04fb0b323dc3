"""An emulated GPU on the CPU: slot memory in host RAM, a throttled background copy engine, a compute timing model.

It lets the hybrid executor run (and be measured) on machines without a GPU, through the same
code CUDA runs: its tensors are ordinary CPU tensors, device work is the same torch code
(``cuda_kernels.grouped_matmul`` on CPU tensors), queued by ``enqueue`` and run in order at the
next ``flush`` / ``to_host`` / ``synchronize``, as a stream runs it after the launches. The
copies are real memcpys done by one persistent copy thread, paced to ``b_p`` bytes/s, so they
compete for DRAM with the CPU branch the way DMA over PCIe does. ``charge_compute`` books the
time a GPU reading ``b_dev`` bytes/s of weights would take (the real time of the torch code on
these cores is not a GPU's), and sleeps it when ``sleep_compute``.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from .pinning import PinReport, pin_host_tensors, unpin
from .device import (
    DeviceInfo,
    DeviceMemoryError,
    DeviceStats,
    FinishedCopy,
    SlotLayout,
    SlotStore,
    check_copy,
    check_layout,
    copy_pieces,
    move_rows,
    resize_rows,
)

DEFAULT_CHUNK_BYTES = 1 << 20  # the pacing grain: sleep after every chunk so bytes/elapsed <= b_p


class EmulatedCopy:
    """Handle of one batch of row copies queued on the emulated copy engine."""

    def __init__(self, pieces: list[tuple[np.ndarray, np.ndarray]], nbytes: int) -> None:
        self.nbytes = nbytes
        self._pieces = pieces  # (dst bytes, src bytes) numpy views of the tensors; dropped once copied
        self._event = threading.Event()
        self._seconds = 0.0
        self._error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"emulated copy of {self.nbytes} bytes not finished after {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"emulated copy of {self.nbytes} bytes failed: {self._error}") from self._error

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def seconds(self) -> float:
        return self._seconds


@dataclass
class _Totals:
    lock: threading.Lock = field(default_factory=threading.Lock)
    num_copies: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0
    num_compute_charges: int = 0
    compute_bytes: int = 0
    compute_seconds: float = 0.0
    host_syncs: int = 0


class _CopyEngine:
    """The copy thread and its queue. Holds no reference to the device, so the device can be collected."""

    def __init__(self, b_p: float, chunk_bytes: int, totals: _Totals) -> None:
        self.b_p = b_p
        self.chunk_bytes = chunk_bytes
        self.totals = totals
        self.jobs: queue.Queue[EmulatedCopy | None] = queue.Queue()
        self._link_free_at = 0.0  # monotonic time at which the emulated link is next idle
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: EmulatedCopy) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="moed-emulated-copy", daemon=True)
                self._thread.start()
        self.jobs.put(job)

    def stop(self) -> None:
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self.jobs.put(None)
            thread.join()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                self._copy(job)
            finally:
                self.jobs.task_done()

    def _copy(self, job: EmulatedCopy) -> None:
        start = time.monotonic()
        # A link idle since before this job starts fresh: idle time is not saved up as credit.
        link = max(self._link_free_at, start)
        try:
            for dst, src in job._pieces:
                n = dst.shape[0]
                for off in range(0, n, self.chunk_bytes):
                    end = min(off + self.chunk_bytes, n)
                    # numpy: one plain memcpy per chunk with the GIL released. torch's copy_ from
                    # this thread goes through intra-op parallelism and ran ~100x slower here.
                    np.copyto(dst[off:end], src[off:end])
                    if math.isfinite(self.b_p):
                        link += (end - off) / self.b_p
                        delay = link - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
        except BaseException as exc:  # reported to whoever waits on the handle
            job._error = exc
        self._link_free_at = link
        job._seconds = time.monotonic() - start
        job._pieces = []
        with self.totals.lock:
            self.totals.num_copies += 1
            self.totals.bytes_copied += job.nbytes
            self.totals.copy_seconds += job._seconds
        job._event.set()


_all_lock = threading.Lock()
_all_allocated = 0  # device bytes held by every emulated device of this process


def emulated_device_bytes() -> int:
    """Device memory held by all emulated devices in this process (``torch.cuda.memory_allocated``'s twin)."""
    return _all_allocated


def _book_all(nbytes: int) -> None:
    global _all_allocated
    with _all_lock:
        _all_allocated += nbytes


class _Ledger:
    """Bytes of slot storage handed out, returned when freed or when the tensor is collected."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.allocated = 0
        self.owned: dict[int, tuple[int, weakref.finalize]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        key = id(tensor)
        fin = weakref.finalize(tensor, self._forget, key)
        with self.lock:
            self.allocated += nbytes
            self.owned[key] = (nbytes, fin)
        _book_all(nbytes)

    def release(self, tensor: torch.Tensor) -> None:
        with self.lock:
            entry = self.owned.get(id(tensor))
        if entry is not None:
            entry[1]()  # runs _forget once; the finalizer is then dead

    def _forget(self, key: int) -> None:
        with self.lock:
            entry = self.owned.pop(key, None)
            if entry is not None:
                self.allocated -= entry[0]
        if entry is not None:
            _book_all(-entry[0])


class EmulatedDevice:
    """A GPU stand-in: host-RAM slots, copies paced to ``b_p`` bytes/s, compute charged at ``b_dev`` bytes/s."""

    kind = "emulated"
    compute_device = torch.device("cpu")

    def __init__(
        self,
        b_p: float = 25e9,
        b_dev: float = 1e12,
        flops_dev: float = 200e12,
        capacity_bytes: int | None = None,
        sleep_compute: bool = False,
        *,
        timing_only: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not (b_p > 0):
            raise ValueError(f"emulated device: b_p (link bytes/s) must be > 0 (math.inf = unthrottled), got {b_p}")
        if not (b_dev > 0):
            raise ValueError(f"emulated device: b_dev (compute bytes/s) must be > 0, got {b_dev}")
        if timing_only and not sleep_compute:
            raise ValueError("emulated device: timing_only (no arithmetic) only makes sense with sleep_compute")
        if not (flops_dev > 0):
            raise ValueError(f"emulated device: flops_dev (FLOP/s) must be > 0, got {flops_dev}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"emulated device: capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        if chunk_bytes < 1:
            raise ValueError(f"emulated device: chunk_bytes must be >= 1, got {chunk_bytes}")
        self.b_p = float(b_p)
        self.b_dev = float(b_dev)
        self.flops_dev = float(flops_dev)
        self.capacity_bytes = capacity_bytes
        self.sleep_compute = sleep_compute
        self.timing_only = timing_only
        self._totals = _Totals()
        self._ledger = _Ledger()
        self._engine = _CopyEngine(self.b_p, chunk_bytes, self._totals)
        self._work: list[Callable[[], None]] = []  # the compute stream: queued, run in order at a flush
        # stop the copy thread when the device is collected or the program exits
        self._finalizer = weakref.finalize(self, self._engine.stop)

    # ----------------------------------------------------------------- memory

    def set_link_bandwidth(self, b_p: float) -> None:
        """Change the emulated link's pace (e.g. to model another machine, or a download taking PCIe)."""
        if not (b_p > 0):
            raise ValueError(f"emulated device: b_p (link bytes/s) must be > 0, got {b_p}")
        self.b_p = float(b_p)
        self._engine.b_p = self.b_p

    def info(self) -> DeviceInfo:
        link = "unthrottled" if math.isinf(self.b_p) else f"{self.b_p / 1e9:.2f} GB/s"
        name = f"emulated GPU (link {link}, compute {self.b_dev / 1e9:.1f} GB/s)"
        free = None if self.capacity_bytes is None else max(self.capacity_bytes - self._ledger.allocated, 0)
        return DeviceInfo(self.kind, name, self.capacity_bytes, free)

    def _alloc(self, kind: str, num_slots: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shape = (num_slots, *row_shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.capacity_bytes is not None and self._ledger.allocated + nbytes > self.capacity_bytes:
            raise DeviceMemoryError(
                f"emulated device: {kind!r} slots {shape} need {nbytes} bytes but only "
                f"{self.capacity_bytes - self._ledger.allocated} of {self.capacity_bytes} are free; "
                f"use fewer slots or a larger capacity_bytes"
            )
        # zero-filled, so pages are faulted in now, as VRAM is ready when allocated: first-touch
        # faults in the copy thread would otherwise slow the first copies into a slot well below b_p
        t = torch.zeros(shape, dtype=dtype)
        self._ledger.add(t)
        return t

    def alloc_slots(self, num_slots: int, layout: SlotLayout) -> SlotStore:
        check_layout(num_slots, layout)
        store: SlotStore = {}
        try:
            for kind, (row_shape, dtype) in layout.items():
                store[kind] = self._alloc(kind, num_slots, tuple(int(n) for n in row_shape), dtype)
        except DeviceMemoryError:
            self.free_slots(store)
            raise
        return store

    def free_slots(self, storage: SlotStore) -> None:
        self.synchronize()
        for t in storage.values():
            self._ledger.release(t)
        storage.clear()

    # ----------------------------------------------------------------- copies

    def copy_rows_async(
        self,
        dst: SlotStore,
        dst_slots: list[int],
        src: dict[str, torch.Tensor],
        src_rows: list[int],
        *,
        wait_for_compute: bool = True,
    ) -> EmulatedCopy | FinishedCopy:
        """``wait_for_compute``: queued device work (which may read the slots written here) runs first."""
        check_copy(dst, dst_slots, src, src_rows)
        for kind in dst:
            if dst[kind].device.type != "cpu" or src[kind].device.type != "cpu":
                raise ValueError(f"emulated device copies CPU tensors only; {kind!r} is not on the CPU")
        if not dst_slots:
            return FinishedCopy()
        if wait_for_compute:
            self.flush()
        pieces = []
        nbytes = 0
        for d, s in copy_pieces(dst, dst_slots, src, src_rows):
            dv = d.reshape(-1).view(torch.uint8).numpy()  # [bytes], a view of the slot rows (contiguous)
            sv = s.reshape(-1).view(torch.uint8).numpy()
            pieces.append((dv, sv))
            nbytes += dv.shape[0]
        job = EmulatedCopy(pieces, nbytes)
        self._engine.submit(job)
        return job

    def move_slots(self, storage: SlotStore, moves: list[tuple[int, int]]) -> None:
        self.synchronize()
        move_rows(storage, moves)

    def resize_slots(self, storage: SlotStore, new_num_slots: int, moves: list[tuple[int, int]]) -> SlotStore:
        if new_num_slots < 0:
            raise ValueError(f"new_num_slots must be >= 0, got {new_num_slots}")
        self.synchronize()
        return resize_rows(storage, new_num_slots, moves, self._alloc, self._ledger.release)

    # ----------------------------------------------------------------- compute and timing

    def charge_compute(self, nbytes: int, flops: float = 0.0) -> float:
        """Seconds a device needs to read ``nbytes`` of weights at ``b_dev`` bytes/s or to do ``flops`` at
        ``flops_dev``, whichever is longer (a roofline); booked, and slept if asked."""
        if nbytes < 0 or flops < 0:
            raise ValueError(f"charge_compute: nbytes and flops must be >= 0, got {nbytes}, {flops}")
        seconds = max(nbytes / self.b_dev, flops / self.flops_dev)
        with self._totals.lock:
            self._totals.num_compute_charges += 1
            self._totals.compute_bytes += nbytes
            self._totals.compute_seconds += seconds
        if self.sleep_compute and seconds > 0:
            time.sleep(seconds)
        return seconds

    # ----------------------------------------------------------------- pinned host memory

    def pin_host(self, tensors: list[torch.Tensor]) -> PinReport:
        """Book the host bank as pinned (host RAM is this device's memory: nothing to lock), through the real ledger."""
        return pin_host_tensors(tensors, register=lambda ptr, nbytes: True, unregister=lambda ptr: None,
                                method="emulated")

    def unpin_host(self, report: PinReport) -> None:
        unpin(report, unregister=lambda ptr: None)

    # ----------------------------------------------------------------- compute in stream order

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """A model tensor (non-expert weight, KV cache) made device-resident: here the same host tensor,
        booked as device memory until it is collected, as VRAM would be taken."""
        if tensor.device.type != "cpu":
            raise ValueError(f"emulated device: tensors live in host RAM, got one on {tensor.device}")
        with self._ledger.lock:
            known = id(tensor) in self._ledger.owned
        if not known:
            self._ledger.add(tensor)
        return tensor

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host RAM is this device's memory: a CPU tensor is already there."""
        if tensor.device.type != "cpu":
            raise ValueError(f"emulated device: tensors live in host RAM, got one on {tensor.device}")
        return tensor

    def enqueue(self, work: Callable[[], None]) -> None:
        self._work.append(work)

    def wait_copy(self, handle) -> None:
        self._work.append(lambda: handle.wait())

    def flush(self) -> None:
        """Run the queued work in order; on a failure the rest is dropped and the error raised here."""
        while self._work:
            work, self._work = self._work, []
            try:
                for item in work:
                    item()
            except BaseException:
                self._work = []
                raise

    def to_host(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._count_sync()
        self.flush()
        return tensors

    def grouped_matmul(self, x: torch.Tensor, slots: SlotStore, name: str, slot_ids: Sequence[int],
                       offsets: Sequence[int]) -> torch.Tensor:
        """The torch code CUDA runs for non-int4 slots, and int4's torch twin, on CPU tensors.

        ``timing_only`` devices return zeros of the right shape instead: for benchmarks of the
        executor's schedule under the timing model only (results are meaningless there).
        """
        from .cuda_kernels import grouped_matmul, output_width

        if self.timing_only:
            return torch.zeros((x.shape[0], output_width(slots, name)), dtype=torch.float32)
        return grouped_matmul(x, slots, name, slot_ids, offsets)

    def _count_sync(self) -> None:
        with self._totals.lock:
            self._totals.host_syncs += 1

    def synchronize(self) -> None:
        """Run the queued work and wait until every queued copy has landed."""
        self._count_sync()
        self.flush()
        self._engine.jobs.join()

    def stats(self) -> DeviceStats:
        t = self._totals
        with t.lock:
            return DeviceStats(
                t.num_copies, t.bytes_copied, t.copy_seconds, t.num_compute_charges, t.compute_bytes, t.compute_seconds,
                t.host_syncs,
            )

    def close(self) -> None:
        """Stop the copy thread (after the queued copies). The device can still allocate; a new copy restarts it."""
        self.synchronize()
        self._engine.stop()
