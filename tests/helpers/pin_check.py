"""Check a PinReport against the memory itself: which bytes its regions cover, and (with CUDA) what the driver says."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import torch

from moed.devices import PinReport

PAGE = mmap.PAGESIZE


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()


def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def region_bytes_in(t: torch.Tensor, regions: tuple[tuple[int, int], ...]) -> int:
    """Bytes of ``t`` that lie inside the registered byte ranges ``regions`` ((ptr, nbytes) pairs)."""
    return sum(overlap(byte_range(t), (p, p + n)) for p, n in regions)


def mmap_tensor(nbytes: int) -> torch.Tensor:
    """A uint8 tensor on its own anonymous mapping: page-aligned, and no page shared with any other tensor."""
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8)  # keeps ``buf`` alive


def cuda_is_pinned_at(ptr: int) -> bool:
    """Does the CUDA driver see host address ``ptr`` as page-locked (``cudaPointerGetAttributes`` type host)?

    ``Tensor.is_pinned()`` asks about the start of a tensor's storage, so a one-byte tensor is made
    whose storage starts at ``ptr`` (numpy over a ctypes buffer at that address; nothing is copied).
    """
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * 1).from_address(ptr))
    return bool(torch.from_numpy(arr).is_pinned())


def assert_regions_pinned(report: PinReport) -> None:
    """Every byte range the report says it registered is page-locked: first, middle and last byte."""
    for p, n in report.regions:
        for at in (p, p + n // 2, p + n - 1):
            assert cuda_is_pinned_at(at), f"report region ({p:#x}, {n}) claims pinned, but byte {at:#x} is not"


def assert_pinned_as_reported(report: PinReport, tensors: list[torch.Tensor]) -> None:
    """With tensors that share no page (``mmap_tensor``): reported-pinned bytes are locked, the rest are not.

    Also the totals: ``pinned_bytes`` is exactly the tensor bytes inside the regions.
    """
    assert_regions_pinned(report)
    covered = [region_bytes_in(t, report.regions) for t in tensors]
    assert report.pinned_bytes == sum(covered), (report, covered)
    assert report.pageable_bytes == sum(t.numel() * t.element_size() for t in tensors) - sum(covered), report
    for t, c in zip(tensors, covered):
        lo, hi = byte_range(t)
        if c == hi - lo:
            assert t.is_pinned(), f"tensor at {lo:#x} is reported pinned but the driver says it is not"
        elif c == 0:
            assert not cuda_is_pinned_at(lo) and not cuda_is_pinned_at(hi - 1), (
                f"tensor at {lo:#x} is reported pageable but the driver says it is pinned"
            )
