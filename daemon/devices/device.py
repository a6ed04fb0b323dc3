"""The device interface: slot memory, host->device row copies, device compute in stream order, host syncs.

A *slot store* is a dict ``kind -> tensor [num_slots, *row_shape]`` with the same kinds as the
host expert bank (``gate_up``, ``down``, ``gate_up.q`` ...): slot ``s`` of every kind together
holds one expert, exactly as row ``flat_id`` of every bank tensor does. Devices move whole rows;
what the rows mean is the executor's business. Nothing here imports the rest of ``moed``.

Device work follows CUDA's stream model on every device: ``enqueue`` queues work that runs in
order and writes into tensors made before it, ``wait_copy`` makes later work wait for a copy
without blocking the host, and only ``to_host`` / ``synchronize`` block the host (each is one
*host sync*, counted in ``DeviceStats.host_syncs``). CUDA runs queued work as it is launched
(kernels are asynchronous); the emulated device queues it and runs it at the next ``flush``,
``to_host`` or ``synchronize``, so the same executor code is correct on both and the counted
syncs are the ones CUDA would do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from .pinning import PinReport

# kind -> (row shape, dtype): what ``alloc_slots`` needs to build slot storage
SlotLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]
SlotStore = dict[str, torch.Tensor]

DEVICE_KINDS = ("cuda", "emulated", "cpu")


class DeviceMemoryError(MemoryError):
    """The device cannot hold the requested slot storage."""


@dataclass(frozen=True)
class DeviceInfo:
    """What a device is and how much slot memory it has (``None`` where unknown)."""

    kind: str  # one of DEVICE_KINDS
    name: str
    total_bytes: int | None
    free_bytes: int | None


@dataclass(frozen=True)
class DeviceStats:
    """Running totals since the device was made: copies finished so far and charged compute."""

    num_copies: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0  # time the copies occupied the link (measured)
    num_compute_charges: int = 0
    compute_bytes: int = 0
    compute_seconds: float = 0.0  # emulated: charged by the timing model; cuda: measured by events around enqueued work
    host_syncs: int = 0  # to_host / synchronize calls: the points where the host waited for the device

    @property
    def copy_bytes_per_second(self) -> float:
        return self.bytes_copied / self.copy_seconds if self.copy_seconds > 0 else 0.0


@runtime_checkable
class CopyHandle(Protocol):
    """One batch of row copies in flight. ``seconds`` / ``nbytes`` are final once ``done()``."""

    nbytes: int

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copies have landed; re-raise a failure of the copy."""
        ...

    def done(self) -> bool: ...

    @property
    def seconds(self) -> float:
        """Measured transfer time (link busy time, queueing excluded); valid once ``done()``."""
        ...


@runtime_checkable
class Device(Protocol):
    """Where cached experts live and run: a CUDA GPU, an emulated one, or none (cpu)."""

    kind: str

    def info(self) -> DeviceInfo: ...

    def alloc_slots(self, num_slots: int, layout: SlotLayout) -> SlotStore: ...

    def free_slots(self, storage: SlotStore) -> None:
        """Give the storage's memory back; the dict is emptied."""
        ...

    def copy_rows_async(
        self,
        dst: SlotStore,
        dst_slots: list[int],
        src: dict[str, torch.Tensor],
        src_rows: list[int],
        *,
        wait_for_compute: bool = True,
    ) -> CopyHandle:
        """For every kind, copy ``src[kind][src_rows[i]]`` into ``dst[kind][dst_slots[i]]`` (host -> device).

        A kind whose rows are 1-D may have shorter source rows than slot rows: they fill each slot row's
        start (``prefix_kinds``; slots that hold matrices of several sizes, as a GGUF bank's layers)."""
        ...

    def move_slots(self, storage: SlotStore, moves: list[tuple[int, int]]) -> None:
        """Copy slot ``old`` to slot ``new`` for every ``(old, new)``, as if all reads happened first."""
        ...

    def resize_slots(self, storage: SlotStore, new_num_slots: int, moves: list[tuple[int, int]]) -> SlotStore:
        """New storage of ``new_num_slots`` holding old slot ``old`` at ``new`` per move; ``storage`` is emptied."""
        ...

    def charge_compute(self, nbytes: int, flops: float = 0.0) -> float:
        """The emulated device's timing model (seconds booked); 0 where real kernels run and are timed."""
        ...

    def pin_host(self, tensors: list[torch.Tensor]) -> "PinReport":
        """Page-lock the host bank for DMA as far as the OS allows (never raises for a refusal)."""
        ...

    def unpin_host(self, report: "PinReport") -> None:
        """Undo ``pin_host`` (before the bank's memory is freed)."""
        ...

    # -- compute in stream order (see the module docstring) -------------------------------------
    compute_device: torch.device  # where device tensors live (the emulated device: host RAM)

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """A model tensor (weight, KV cache) made resident on the device for good (at load)."""
        ...

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor's copy on the device, queued in stream order; the host does not wait."""
        ...

    def to_host(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device tensors on the host once the work queued so far has run: one host sync for all."""
        ...

    def enqueue(self, work: Callable[[], None]) -> None:
        """Device work in stream order; it writes its results into tensors made before it."""
        ...

    def wait_copy(self, handle: CopyHandle) -> None:
        """Device work queued after this waits for ``handle``'s copies; the host does not wait."""
        ...

    def flush(self) -> None:
        """Queued work runs before host-side torch work that follows (a no-op where streams order it)."""
        ...

    def grouped_matmul(self, x: torch.Tensor, slots: SlotStore, name: str, slot_ids: Sequence[int],
                       offsets: Sequence[int]) -> torch.Tensor:
        """``x [T, K]`` float32, rows ``offsets[e]:offsets[e+1]`` times matrix ``name`` of slot ``slot_ids[e]``."""
        ...

    def synchronize(self) -> None: ...

    def stats(self) -> DeviceStats: ...


# --------------------------------------------------------------------------- shared helpers


def slot_layout(tensors: dict[str, torch.Tensor]) -> SlotLayout:
    """The slot layout that mirrors bank tensors indexed by flat id on dim 0."""
    layout: SlotLayout = {}
    for kind, t in tensors.items():
        if t.dim() < 1:
            raise ValueError(f"bank tensor {kind!r} is a scalar; bank tensors are indexed by flat id on dim 0")
        layout[kind] = (tuple(t.shape[1:]), t.dtype)
    return layout


def slot_nbytes(layout: SlotLayout) -> int:
    """Bytes of one slot (one row of every kind)."""
    total = 0
    for shape, dtype in layout.values():
        numel = 1
        for n in shape:
            numel *= n
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def store_nbytes(storage: SlotStore) -> int:
    return sum(t.numel() * t.element_size() for t in storage.values())


def check_layout(num_slots: int, layout: SlotLayout) -> None:
    if num_slots < 0:
        raise ValueError(f"num_slots must be >= 0, got {num_slots}")
    if not layout:
        raise ValueError("slot layout is empty: pass one (row_shape, dtype) per bank tensor kind")
    for kind, entry in layout.items():
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.dtype)):
            raise ValueError(f"slot layout {kind!r} must be (row_shape, torch.dtype), got {entry!r}")
        if any(int(n) < 0 for n in entry[0]):
            raise ValueError(f"slot layout {kind!r} has a negative dimension: {entry[0]}")


def num_slots_of(storage: SlotStore) -> int:
    sizes = {t.shape[0] for t in storage.values()}
    if len(sizes) > 1:
        raise ValueError(f"slot storage kinds disagree on the number of slots: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def check_copy(dst: SlotStore, dst_slots: list[int], src: dict[str, torch.Tensor], src_rows: list[int]) -> None:
    """Validate a row copy before anything is queued: same kinds, row shapes, dtypes, indices in range."""
    if len(dst_slots) != len(src_rows):
        raise ValueError(f"dst_slots has {len(dst_slots)} entries but src_rows has {len(src_rows)}")
    if set(dst) != set(src):
        raise ValueError(f"slot storage kinds {sorted(dst)} differ from source kinds {sorted(src)}")
    if len(set(dst_slots)) != len(dst_slots):
        raise ValueError(f"dst_slots repeats a slot: {sorted(dst_slots)}")
    num_slots = num_slots_of(dst)
    prefix = prefix_kinds(dst, src)
    for kind, d in dst.items():
        s = src[kind]
        if d.dtype != s.dtype or (tuple(d.shape[1:]) != tuple(s.shape[1:]) and kind not in prefix):
            raise ValueError(
                f"{kind!r}: slot rows are {d.dtype} {tuple(d.shape[1:])} but source rows are "
                f"{s.dtype} {tuple(s.shape[1:])}"
            )
        if not s.is_contiguous() or not d.is_contiguous():
            raise ValueError(f"{kind!r}: source and slot tensors must be contiguous")
    for slot in dst_slots:
        if not 0 <= slot < num_slots:
            raise ValueError(f"slot {slot} out of range (storage has {num_slots} slots)")
    num_rows = num_slots_of(src) if src else 0
    for row in src_rows:
        if not 0 <= row < num_rows:
            raise ValueError(f"source row {row} out of range (source has {num_rows} rows)")


def prefix_kinds(dst: SlotStore, src: dict[str, torch.Tensor]) -> set[str]:
    """Kinds whose 1-D source rows are shorter than the slot rows: each copy fills the start of its slot row."""
    return {kind for kind, d in dst.items()
            if kind in src and d.dim() == 2 and src[kind].dim() == 2 and src[kind].shape[1] < d.shape[1]}


def row_runs(dst_slots: list[int], src_rows: list[int]) -> list[tuple[int, int, int]]:
    """``(dst_start, src_start, count)`` runs where consecutive pairs advance together: one copy per run."""
    runs: list[tuple[int, int, int]] = []
    for d, s in zip(dst_slots, src_rows):
        if runs:
            d0, s0, n = runs[-1]
            if d == d0 + n and s == s0 + n:
                runs[-1] = (d0, s0, n + 1)
                continue
        runs.append((d, s, 1))
    return runs


def copy_pieces(dst: SlotStore, dst_slots: list[int], src: dict[str, torch.Tensor],
                src_rows: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(slot part, source part)`` pairs, each a contiguous view, that together make the row copy: a run
    of consecutive rows is one pair; a prefix kind (``prefix_kinds``) is one pair per row."""
    prefix = prefix_kinds(dst, src)
    pieces = []
    for kind, d in dst.items():
        s = src[kind]
        if kind in prefix:
            width = s.shape[1]
            pieces += [(d[slot, :width], s[row]) for slot, row in zip(dst_slots, src_rows)]
        else:
            pieces += [(d[d0 : d0 + n], s[s0 : s0 + n]) for d0, s0, n in row_runs(dst_slots, src_rows)]
    return pieces


def check_moves(moves: list[tuple[int, int]], num_old: int, num_new: int) -> None:
    news = [new for _, new in moves]
    if len(set(news)) != len(news):
        raise ValueError(f"moves write one slot twice: {sorted(news)}")
    for old, new in moves:
        if not 0 <= old < num_old:
            raise ValueError(f"move source slot {old} out of range (storage has {num_old} slots)")
        if not 0 <= new < num_new:
            raise ValueError(f"move destination slot {new} out of range (storage has {num_new} slots)")


def move_rows(storage: SlotStore, moves: list[tuple[int, int]]) -> None:
    """In-place ``storage[k][new] = storage[k][old]`` for all moves at once (reads gathered before writes)."""
    num = num_slots_of(storage)
    check_moves(moves, num, num)
    moves = [(old, new) for old, new in moves if old != new]
    if not moves:
        return
    for t in storage.values():
        old_idx = torch.tensor([old for old, _ in moves], dtype=torch.long, device=t.device)
        new_idx = torch.tensor([new for _, new in moves], dtype=torch.long, device=t.device)
        t.index_copy_(0, new_idx, t.index_select(0, old_idx))  # index_select copies: order-safe


def resize_rows(
    storage: SlotStore, new_num_slots: int, moves: list[tuple[int, int]], alloc: "_Alloc", release: "_Release"
) -> SlotStore:
    """Kind by kind: allocate the new tensor, copy the moved rows, release the old one (peak = old + one kind)."""
    check_moves(moves, num_slots_of(storage), new_num_slots)
    new_store: SlotStore = {}
    for kind in list(storage):
        old = storage[kind]
        new = alloc(kind, new_num_slots, tuple(old.shape[1:]), old.dtype)
        if moves:
            old_idx = torch.tensor([o for o, _ in moves], dtype=torch.long, device=old.device)
            new_idx = torch.tensor([n for _, n in moves], dtype=torch.long, device=new.device)
            new.index_copy_(0, new_idx, old.index_select(0, old_idx))
        del storage[kind]
        release(old)
        del old
        new_store[kind] = new
    return new_store


class _Alloc(Protocol):
    def __call__(self, kind: str, num_slots: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class _Release(Protocol):
    def __call__(self, tensor: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class FinishedCopy:
    """A copy handle for a batch that needed no work (no rows, or a device without slots)."""

    nbytes: int = 0

    def wait(self, timeout: float | None = None) -> None:
        return None

    def done(self) -> bool:
        return True

    @property
    def seconds(self) -> float:
        return 0.0
