"""No accelerator: a device with zero slots, so every routed expert runs on the CPU from the host bank."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .pinning import PinReport
from .device import (
    DeviceInfo,
    DeviceStats,
    FinishedCopy,
    SlotLayout,
    SlotStore,
    check_copy,
    check_layout,
    check_moves,
    num_slots_of,
)


class CpuDevice:
    """The CPU-only backend's device: holds no expert slots (capacity 0), copies nothing, charges nothing."""

    kind = "cpu"
    compute_device = torch.device("cpu")

    def info(self) -> DeviceInfo:
        return DeviceInfo(self.kind, "cpu (no device memory: all experts run from the host bank)", 0, 0)

    def alloc_slots(self, num_slots: int, layout: SlotLayout) -> SlotStore:
        check_layout(num_slots, layout)
        if num_slots != 0:
            raise ValueError(
                f"the cpu device has no slot memory: asked for {num_slots} slots; "
                f"size the expert cache to 0 slots, or select a 'cuda' or 'emulated' device"
            )
        return {kind: torch.empty((0, *shape), dtype=dtype) for kind, (shape, dtype) in layout.items()}

    def free_slots(self, storage: SlotStore) -> None:
        storage.clear()

    def copy_rows_async(
        self,
        dst: SlotStore,
        dst_slots: list[int],
        src: dict[str, torch.Tensor],
        src_rows: list[int],
        *,
        wait_for_compute: bool = True,
    ) -> FinishedCopy:
        check_copy(dst, dst_slots, src, src_rows)  # any slot index is out of range: there are none
        return FinishedCopy()

    def move_slots(self, storage: SlotStore, moves: list[tuple[int, int]]) -> None:
        check_moves(moves, num_slots_of(storage), num_slots_of(storage))

    def resize_slots(self, storage: SlotStore, new_num_slots: int, moves: list[tuple[int, int]]) -> SlotStore:
        if new_num_slots != 0:
            raise ValueError(f"the cpu device has no slot memory: cannot resize to {new_num_slots} slots")
        check_moves(moves, num_slots_of(storage), 0)
        return storage

    def charge_compute(self, nbytes: int, flops: float = 0.0) -> float:
        return 0.0

    def pin_host(self, tensors: list[torch.Tensor]) -> PinReport:
        total = sum(t.numel() * t.element_size() for t in tensors)
        return PinReport(0, total, "none", "the cpu device copies nothing to a device: nothing is pinned")

    def unpin_host(self, report: PinReport) -> None:
        return None

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def to_host(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors  # nothing runs anywhere else: never a wait

    def enqueue(self, work: Callable[[], None]) -> None:
        work()

    def wait_copy(self, handle) -> None:
        return None

    def flush(self) -> None:
        return None

    def grouped_matmul(self, x: torch.Tensor, slots: SlotStore, name: str, slot_ids: Sequence[int],
                       offsets: Sequence[int]) -> torch.Tensor:
        raise ValueError("the cpu device has no slots to compute from; every expert runs from the host bank")

    def synchronize(self) -> None:
        return None

    def stats(self) -> DeviceStats:
        return DeviceStats()
