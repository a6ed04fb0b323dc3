"""pin_host_tensors: full, partial and failed pinning (simulated through an injected register), the real path on CUDA."""

from __future__ import annotations

import mmap

import pytest
import torch

from moed.devices import PinReport, can_pin, memlock_limit_bytes, pin_host_tensors, unpin

PAGE = mmap.PAGESIZE
MiB = 1 << 20


class FakeOS:
    """A page-locking budget like RLIMIT_MEMLOCK: locks whole pages, refuses a page twice, refuses past the budget."""

    def __init__(self, budget: int | None = None, *, raise_on_refusal: bool = False) -> None:
        self.budget = budget
        self.raise_on_refusal = raise_on_refusal
        self.locked: dict[int, tuple[int, int]] = {}  # ptr -> page span [first, last)
        self.calls = 0

    def used(self) -> int:
        return sum((b - a) * PAGE for a, b in self.locked.values())

    def register(self, ptr: int, nbytes: int) -> bool:
        self.calls += 1
        span = (ptr // PAGE, -(-(ptr + nbytes) // PAGE))
        overlaps = any(a < span[1] and span[0] < b for a, b in self.locked.values())
        too_big = self.budget is not None and self.used() + (span[1] - span[0]) * PAGE > self.budget
        if overlaps or too_big:
            if self.raise_on_refusal:
                raise RuntimeError("cudaErrorMemoryAllocation")
            return False
        self.locked[ptr] = span
        return True

    def unregister(self, ptr: int) -> None:
        del self.locked[ptr]


def _bank(sizes_mib: tuple[int, ...] = (8, 4, 2)) -> list[torch.Tensor]:
    return [torch.ones(s * MiB, dtype=torch.uint8) for s in sizes_mib]


def test_everything_pinned_when_the_os_allows() -> None:
    tensors = _bank()
    fake = FakeOS()
    report = pin_host_tensors(tensors, register=fake.register)
    assert report.pinned_bytes == 14 * MiB and report.pageable_bytes == 0 and report.is_fully_pinned
    assert report.method == "custom" and report.reason == ""
    assert fake.calls == 3, "each tensor registers whole when it can"
    assert "pinned" in report.summary()
    unpin(report, unregister=fake.unregister)
    assert fake.locked == {}


def test_partial_pin_under_an_os_budget_never_raises() -> None:
    tensors = _bank()
    total = 14 * MiB
    for raise_on_refusal in (False, True):
        fake = FakeOS(budget=10 * MiB + 3 * PAGE, raise_on_refusal=raise_on_refusal)
        report = pin_host_tensors(tensors, register=fake.register, chunk_bytes=MiB)
        assert report.pinned_bytes + report.pageable_bytes == total
        assert 9 * MiB <= report.pinned_bytes <= fake.budget, report
        assert sum(n for _, n in report.regions) <= fake.used() <= fake.budget
        assert "refused" in report.reason and "ulimit -l" in report.reason
        if raise_on_refusal:
            assert "cudaErrorMemoryAllocation" in report.reason
        assert "%" in report.summary() and "pageable" in report.summary()
        unpin(report, unregister=fake.unregister)
        assert fake.locked == {}


def test_limit_bytes_caps_what_is_pinned() -> None:
    tensors = _bank()
    fake = FakeOS()
    limit = 9 * MiB + 123
    report = pin_host_tensors(tensors, limit_bytes=limit, register=fake.register, chunk_bytes=MiB)
    registered = sum(n for _, n in report.regions)
    assert registered <= limit and registered >= limit - MiB
    assert report.pinned_bytes + report.pageable_bytes == 14 * MiB
    assert "limit" in report.reason and "refused" not in report.reason


def test_total_failure_pins_nothing_and_says_why() -> None:
    tensors = _bank()
    fake = FakeOS(budget=0)
    report = pin_host_tensors(tensors, register=fake.register, chunk_bytes=MiB)
    assert report.pinned_bytes == 0 and report.pageable_bytes == 14 * MiB and report.regions == ()
    assert report.reason
    # once the OS keeps refusing, it stops asking instead of trying every chunk of a huge bank
    assert fake.calls <= 3 + 8 + 1, fake.calls
    unpin(report, unregister=fake.unregister)  # nothing to undo: fine


def test_tensors_sharing_a_page_are_not_registered_twice() -> None:
    # two views into one buffer: the second starts inside the first's last page
    buf = torch.ones(4 * PAGE, dtype=torch.uint8)
    a, b = buf[: 2 * PAGE + 100], buf[2 * PAGE + 100 :]
    fake = FakeOS()
    report = pin_host_tensors([a, b], register=fake.register)
    assert report.pinned_bytes == 4 * PAGE and report.pageable_bytes == 0, report
    assert report.reason == ""


def test_without_cuda_nothing_is_pinned() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-CUDA path is not taken")
    report = pin_host_tensors(_bank())
    assert report == PinReport(0, 14 * MiB, "none", report.reason)
    assert "CUDA" in report.reason
    assert can_pin() is False


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        pin_host_tensors([torch.ones(4, 4).t()], register=FakeOS().register)
    with pytest.raises(ValueError, match="page size"):
        pin_host_tensors(_bank(), register=FakeOS().register, chunk_bytes=PAGE + 1)
    with pytest.raises(ValueError, match="unregister"):
        unpin(PinReport(1, 0, "custom", "", ((123, 1),)))


def test_memlock_limit_is_read() -> None:
    limit = memlock_limit_bytes()
    assert limit is None or limit >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_pinning_registers_host_memory() -> None:
    assert can_pin()
    tensors = _bank((16, 1))
    report = pin_host_tensors(tensors)
    try:
        assert report.method == "cudaHostRegister"
        assert report.pinned_bytes + report.pageable_bytes == 17 * MiB
        if report.pinned_bytes == 17 * MiB:
            assert all(t.is_pinned() for t in tensors)
    finally:
        unpin(report)
    assert not tensors[0].is_pinned()
