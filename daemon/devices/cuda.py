"""A CUDA GPU through torch: slot tensors in VRAM, row copies on a dedicated transfer stream timed by events.

Device work runs on the current torch stream as it is launched (``enqueue`` calls it at once);
uploads come from pinned staging memory with ``non_blocking``, so only ``to_host`` and
``synchronize`` make the host wait.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

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


class CudaCopy:
    """Handle of one batch of row copies queued on the transfer stream, bracketed by two timing events."""

    def __init__(
        self,
        device: "CudaDevice",
        start: torch.cuda.Event,
        end: torch.cuda.Event,
        nbytes: int,
        keep_alive: list[torch.Tensor],
    ) -> None:
        self.nbytes = nbytes
        self.event = end  # other streams can wait on it: ``stream.wait_event(handle.event)``
        self._device = device
        self._start = start
        self._keep_alive = keep_alive  # source rows must outlive the asynchronous copy
        self._seconds: float | None = None
        self._finish_lock = threading.Lock()  # books the copy exactly once, whoever looks first

    def wait(self, timeout: float | None = None) -> None:
        # CUDA events have no timed wait; ``timeout`` is accepted for interface parity
        self.event.synchronize()
        self._finish()

    def done(self) -> bool:
        if self._seconds is not None:
            return True
        if not self.event.query():
            return False
        self._finish()
        return True

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for these copies without blocking the host."""
        (stream or torch.cuda.current_stream(self._device.device)).wait_event(self.event)

    @property
    def seconds(self) -> float:
        return self._seconds if self._seconds is not None else 0.0

    def _finish(self) -> None:
        with self._finish_lock:
            if self._seconds is not None:
                return
            seconds = self._start.elapsed_time(self.event) / 1e3  # ms -> s
            self._keep_alive = []
            self._seconds = seconds
        self._device._record_copy(self.nbytes, seconds)


class CudaDevice:
    """One CUDA GPU: slot storage in VRAM, host->device copies on its own stream (async from pinned memory)."""

    kind = "cuda"

    def __init__(self, index: int = 0) -> None:
        if not self.available():
            raise RuntimeError(
                "CUDA is not available (torch.cuda.is_available() is False): install a CUDA build of torch "
                "and an NVIDIA driver, or choose the 'cpu' or 'emulated' device"
            )
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ValueError(f"CUDA device index {index} out of range: this machine has {count} CUDA device(s)")
        self.device = torch.device("cuda", index)
        self.compute_device = self.device
        self.copy_stream = torch.cuda.Stream(self.device)
        self._host_syncs = 0
        self._lock = threading.Lock()
        self._num_copies = 0
        self._bytes = 0
        self._seconds = 0.0
        self._pending: list[CudaCopy] = []
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # enqueued work not yet booked
        self._num_computes = 0
        self._compute_seconds = 0.0

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    # ----------------------------------------------------------------- memory

    def info(self) -> DeviceInfo:
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceInfo(self.kind, torch.cuda.get_device_name(self.device), int(total), int(free))

    def _alloc(self, kind: str, num_slots: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        try:
            return torch.empty((num_slots, *row_shape), dtype=dtype, device=self.device)
        except torch.OutOfMemoryError as exc:
            raise DeviceMemoryError(
                f"{self.device}: no room for {num_slots} {kind!r} slots of {tuple(row_shape)} {dtype}: {exc}; "
                f"use a smaller expert cache"
            ) from exc

    def alloc_slots(self, num_slots: int, layout: SlotLayout) -> SlotStore:
        check_layout(num_slots, layout)
        store: SlotStore = {}
        try:
            for kind, (row_shape, dtype) in layout.items():
                store[kind] = self._alloc(kind, num_slots, tuple(int(n) for n in row_shape), dtype)
        except DeviceMemoryError:
            store.clear()
            torch.cuda.empty_cache()
            raise
        return store

    def free_slots(self, storage: SlotStore) -> None:
        self.copy_stream.synchronize()
        storage.clear()
        torch.cuda.empty_cache()  # give the VRAM back to other applications

    # ----------------------------------------------------------------- copies

    def copy_rows_async(
        self,
        dst: SlotStore,
        dst_slots: list[int],
        src: dict[str, torch.Tensor],
        src_rows: list[int],
        *,
        wait_for_compute: bool = True,
    ) -> CudaCopy | FinishedCopy:
        """Queue the row copies on the transfer stream and return at once.

        ``wait_for_compute``: the transfer stream first waits for work already queued on the
        current stream (which may still read the slots being overwritten). Pass False when the
        destination slots are known idle (e.g. the other buffer of prefill double buffering).
        """
        check_copy(dst, dst_slots, src, src_rows)
        for kind in dst:
            if dst[kind].device != self.device:
                raise ValueError(f"slot storage {kind!r} is on {dst[kind].device}, not {self.device}")
            if src[kind].device.type != "cpu":
                raise ValueError(f"copy source {kind!r} must be host memory, got {src[kind].device}")
        if not dst_slots:
            return FinishedCopy()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        keep: list[torch.Tensor] = []
        nbytes = 0
        if wait_for_compute:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            start.record(self.copy_stream)
            for d, rows in copy_pieces(dst, dst_slots, src, src_rows):
                d.copy_(rows, non_blocking=True)  # contiguous bank rows -> one cudaMemcpyAsync
                keep.append(rows)
                nbytes += rows.numel() * rows.element_size()
            end.record(self.copy_stream)
        handle = CudaCopy(self, start, end, nbytes, keep)
        self._sweep()
        with self._lock:
            self._pending.append(handle)
        return handle

    def _record_copy(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._num_copies += 1
            self._bytes += nbytes
            self._seconds += seconds

    def move_slots(self, storage: SlotStore, moves: list[tuple[int, int]]) -> None:
        self.copy_stream.synchronize()
        move_rows(storage, moves)

    def resize_slots(self, storage: SlotStore, new_num_slots: int, moves: list[tuple[int, int]]) -> SlotStore:
        if new_num_slots < 0:
            raise ValueError(f"new_num_slots must be >= 0, got {new_num_slots}")
        self.copy_stream.synchronize()
        new = resize_rows(storage, new_num_slots, moves, self._alloc, lambda t: None)
        torch.cuda.empty_cache()  # a shrink hands the freed VRAM back to other applications
        return new

    # ----------------------------------------------------------------- compute and timing

    measured_compute = True  # compute time comes from CUDA events around enqueued work (stats().compute_seconds)

    def charge_compute(self, nbytes: int, flops: float = 0.0) -> float:
        return 0.0  # real kernels run: their time is measured by events, not modelled

    # ----------------------------------------------------------------- pinned host memory

    def pin_host(self, tensors: list[torch.Tensor]) -> PinReport:
        """cudaHostRegister as much of ``tensors`` as the OS allows (a refusal leaves no CUDA error behind)."""
        return pin_host_tensors(tensors)

    def unpin_host(self, report: PinReport) -> None:
        unpin(report)

    # ----------------------------------------------------------------- compute in stream order

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """A model tensor (non-expert weight, KV cache) moved to VRAM in its dtype (at load: a blocking copy)."""
        try:
            return tensor.to(self.device)
        except torch.OutOfMemoryError as exc:
            raise DeviceMemoryError(
                f"{self.device}: no room for a model tensor of {tuple(tensor.shape)} {tensor.dtype}: {exc}; "
                "free GPU memory, or load with --device cpu") from exc

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Upload from pinned memory without waiting (a pageable source would make the copy blocking)."""
        if tensor.device == self.device:
            return tensor
        if tensor.device.type != "cpu":
            raise ValueError(f"to_device: expected a host tensor or one on {self.device}, got {tensor.device}")
        src = tensor if tensor.is_pinned() else tensor.pin_memory()  # torch's caching host allocator
        return src.to(self.device, non_blocking=True)

    def to_host(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """All of them into pinned host tensors, then one wait on the current stream."""
        out = []
        for t in tensors:
            if t.device.type == "cpu":
                out.append(t)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        torch.cuda.current_stream(self.device).synchronize()
        with self._lock:
            self._host_syncs += 1
        return tuple(out)

    def enqueue(self, work: Callable[[], None]) -> None:
        """Launch ``work`` now (torch queues its kernels on the current stream), between two timing events
        whose interval is booked as compute seconds once the stream has passed them."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        with self._lock:
            self._timed.append((start, end))

    def wait_copy(self, handle) -> None:
        if isinstance(handle, CudaCopy):
            handle.wait_stream()  # the compute stream waits for the copy's event; the host does not

    def flush(self) -> None:
        return None  # the stream orders device work against everything launched after it

    def grouped_matmul(self, x: torch.Tensor, slots: SlotStore, name: str, slot_ids: Sequence[int],
                       offsets: Sequence[int]) -> torch.Tensor:
        from .cuda_kernels import grouped_matmul

        return grouped_matmul(x, slots, name, slot_ids, offsets)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        with self._lock:
            self._host_syncs += 1
        self.stats()

    def stats(self) -> DeviceStats:
        self._sweep()
        with self._lock:
            return DeviceStats(self._num_copies, self._bytes, self._seconds, self._num_computes, 0,
                               self._compute_seconds, host_syncs=self._host_syncs)

    def _sweep(self) -> None:
        """Book the copies that finished since the last look (``done()`` books them; outside the lock)."""
        with self._lock:
            pending, self._pending = self._pending, []
        still = [h for h in pending if not h.done()]
        with self._lock:
            self._pending = still + self._pending
            timed, self._timed = self._timed, []
        done = [b.query() for _, b in timed]  # a pair is done once the stream has passed its end event
        seconds = sum(a.elapsed_time(b) for (a, b), ok in zip(timed, done) if ok) / 1e3
        with self._lock:
            self._timed = [p for p, ok in zip(timed, done) if not ok] + self._timed
            self._num_computes += sum(done)
            self._compute_seconds += seconds
