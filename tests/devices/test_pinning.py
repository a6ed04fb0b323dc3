"""pin_host_tensors: what it reports against what was really registered.

Without a GPU the CUDA calls are replaced by a fake driver that records every call and the pages
it locked (through the ``register`` hook, and through ``torch.cuda.cudart`` for the default
path), and each report is checked against that record: every region reported was a call the
driver accepted and every accepted call is reported (or ``unpin`` could not undo it); the
pinned bytes are exactly the tensor bytes in locked pages; a limit or a refusal leaves the
right tensors unregistered. With a GPU the driver itself is asked, byte by byte.
"""

from __future__ import annotations

import resource
import subprocess

import pytest
import torch

from moed.devices import PinReport, can_pin, memlock_limit_bytes, pin_host_tensors, unpin
from moed.devices import pinning

from helpers.pin_check import (
    PAGE,
    assert_pinned_as_reported,
    byte_range,
    cuda_is_pinned_at,
    mmap_tensor,
    overlap,
)

MiB = 1 << 20
CUDA_ERROR_MEMORY_ALLOCATION = 2  # what cudaHostRegister returns past RLIMIT_MEMLOCK
CUDA_ERROR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
CUDA_ERROR_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered


class FakeDriver:
    """Page locking as the CUDA driver does it, recorded.

    Locks whole pages; refuses a range touching a page that is locked already; refuses past a
    page budget (like ``RLIMIT_MEMLOCK``); refuses ranges ``refuse(ptr, nbytes)`` says so for.
    """

    def __init__(self, budget: int | None = None, *, raise_on_refusal: bool = False, refuse=None) -> None:
        self.budget = budget
        self.raise_on_refusal = raise_on_refusal
        self.refuse = refuse
        self.calls: list[tuple[int, int, bool]] = []  # (ptr, nbytes, accepted), in call order
        self.locked: dict[int, tuple[int, int]] = {}  # ptr -> (first page, end page)
        self.unregistered: list[int] = []

    def _pages(self, ptr: int, nbytes: int) -> tuple[int, int]:
        return ptr // PAGE, -(-(ptr + nbytes) // PAGE)

    def locked_pages(self) -> set[int]:
        return {p for a, b in self.locked.values() for p in range(a, b)}

    def try_lock(self, ptr: int, nbytes: int) -> int:
        """0 when locked, else a CUDA error number."""
        a, b = self._pages(ptr, nbytes)
        err = 0
        if nbytes <= 0:
            err = 1  # cudaErrorInvalidValue
        elif any(x < b and a < y for x, y in self.locked.values()):
            err = CUDA_ERROR_ALREADY_REGISTERED
        elif self.budget is not None and (len(self.locked_pages()) + b - a) * PAGE > self.budget:
            err = CUDA_ERROR_MEMORY_ALLOCATION
        elif self.refuse is not None and self.refuse(ptr, nbytes):
            err = CUDA_ERROR_MEMORY_ALLOCATION
        if not err:
            self.locked[ptr] = (a, b)
        self.calls.append((ptr, nbytes, not err))
        return err

    def register(self, ptr: int, nbytes: int) -> bool:
        err = self.try_lock(ptr, nbytes)
        if err and self.raise_on_refusal:
            raise RuntimeError(f"cudaErrorMemoryAllocation ({err})")
        return not err

    def unregister(self, ptr: int) -> None:
        if ptr not in self.locked:
            raise RuntimeError(f"cudaErrorHostMemoryNotRegistered: {ptr:#x}")
        del self.locked[ptr]
        self.unregistered.append(ptr)

    def accepted(self) -> tuple[tuple[int, int], ...]:
        return tuple((p, n) for p, n, ok in self.calls if ok)

    def calls_touching(self, t: torch.Tensor) -> list[tuple[int, int, bool]]:
        return [c for c in self.calls if overlap((c[0], c[0] + c[1]), byte_range(t))]

    def locked_bytes_of(self, t: torch.Tensor) -> int:
        """Bytes of ``t`` in locked pages: what really is pinned (computed from the driver's pages, not the report)."""
        lo, hi = byte_range(t)
        pages = self.locked_pages()
        return sum(overlap((lo, hi), (p * PAGE, (p + 1) * PAGE)) for p in range(lo // PAGE, -(-hi // PAGE)) if p in pages)


class FakeCudart:
    """``torch.cuda.cudart()`` for the default path: the two calls pinning.py makes, returning CUDA error numbers."""

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        self.flags: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.flags.append(flags)
        return self.driver.try_lock(ptr, nbytes)

    def cudaHostUnregister(self, ptr: int) -> int:
        if ptr not in self.driver.locked:
            return CUDA_ERROR_NOT_REGISTERED
        self.driver.unregister(ptr)
        return 0


def check_report(report: PinReport, tensors: list[torch.Tensor], driver: FakeDriver) -> list[int]:
    """What must hold for any report; returns the per-tensor bytes really pinned (from the driver)."""
    assert report.regions == driver.accepted(), "report regions must be exactly the registrations the driver accepted"
    for p, n in report.regions:
        assert any(overlap((p, p + n), byte_range(t)) == n for t in tensors), f"region ({p:#x}, {n}) is outside the bank"
    really = [driver.locked_bytes_of(t) for t in tensors]
    assert report.total_bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert report.pinned_bytes <= sum(really), f"report claims {report.pinned_bytes} pinned, the driver locked {really}"
    assert (report.reason == "") == (report.pageable_bytes == 0), report
    return really


def check_unpin(report: PinReport, driver: FakeDriver, **kw) -> None:
    unpin(report, **kw)
    assert driver.unregistered == [p for p, _ in report.regions], "unpin must unregister every region once"
    assert driver.locked == {}, "pages left locked after unpin"


def _bank(sizes: tuple[int, ...] = (8 * MiB, 4 * MiB, 2 * MiB), align: int = MiB) -> list[torch.Tensor]:
    """Views into one arena, back to back from an ``align``-aligned start: their chunks and pages are known."""
    arena = torch.empty(sum(sizes) + align, dtype=torch.uint8)
    pos = (-arena.data_ptr()) % align
    out = []
    for s in sizes:
        out.append(arena[pos : pos + s])
        pos += s
    return out


def _ptrs(tensors: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors]


def ulimit_l_bytes() -> int | None:
    """The soft locked-memory limit as the shell reports it (an oracle independent of ``resource``)."""
    out = subprocess.run(["sh", "-c", "ulimit -l"], capture_output=True, text=True, check=True).stdout.strip()
    return None if out == "unlimited" else int(out) * 1024


# --------------------------------------------------------------------------- injected register


def test_every_tensor_reported_pinned_was_registered() -> None:
    tensors = _bank()
    p0, p1, p2 = _ptrs(tensors)
    driver = FakeDriver()
    report = pin_host_tensors(tensors, register=driver.register)
    assert report.regions == ((p0, 8 * MiB), (p1, 4 * MiB), (p2, 2 * MiB)), "each tensor registers whole"
    assert check_report(report, tensors, driver) == [8 * MiB, 4 * MiB, 2 * MiB]
    assert report.pinned_bytes == 14 * MiB and report.pageable_bytes == 0 and report.is_fully_pinned
    assert report.method == "custom" and report.reason == ""
    assert "pinned: 0.01 GiB (custom)" in report.summary()
    check_unpin(report, driver, unregister=driver.unregister)


@pytest.mark.parametrize("raise_on_refusal", [False, True])
def test_os_budget_pins_a_prefix_and_reports_the_rest_pageable(raise_on_refusal: bool) -> None:
    tensors = _bank()
    p0, p1, _ = _ptrs(tensors)
    driver = FakeDriver(budget=10 * MiB + 3 * PAGE, raise_on_refusal=raise_on_refusal)
    report = pin_host_tensors(tensors, register=driver.register, chunk_bytes=MiB)
    # tensor 0 whole; tensor 1 refused whole, then 1 MiB chunks until the budget; tensor 2 refused
    assert report.regions == ((p0, 8 * MiB), (p1, MiB), (p1 + MiB, MiB)), report.regions
    assert check_report(report, tensors, driver) == [8 * MiB, 2 * MiB, 0]
    assert report.pinned_bytes == 10 * MiB and report.pageable_bytes == 4 * MiB
    assert driver.calls_touching(tensors[2]), "tensor 2 was never tried"
    assert "refused" in report.reason and "ulimit -l" in report.reason
    lim = ulimit_l_bytes()
    assert f"RLIMIT_MEMLOCK is {'unlimited' if lim is None else f'{lim} bytes'}" in report.reason, report.reason
    assert ("cudaErrorMemoryAllocation" in report.reason) == raise_on_refusal
    assert "71% pinned" in report.summary() and "pageable" in report.summary()
    check_unpin(report, driver, unregister=driver.unregister)


def test_a_refused_tensor_is_reported_pageable() -> None:
    tensors = _bank()
    p0, _, p2 = _ptrs(tensors)
    bad = byte_range(tensors[1])
    driver = FakeDriver(refuse=lambda p, n: overlap((p, p + n), bad) > 0)
    report = pin_host_tensors(tensors, register=driver.register, chunk_bytes=MiB)
    assert report.regions == ((p0, 8 * MiB), (p2, 2 * MiB)), report.regions
    assert check_report(report, tensors, driver) == [8 * MiB, 0, 2 * MiB]
    assert report.pinned_bytes == 10 * MiB and report.pageable_bytes == 4 * MiB
    # the refused tensor was tried whole, then chunk by chunk
    assert [c[1] for c in driver.calls_touching(tensors[1])] == [4 * MiB] + [MiB] * 4
    assert "refused" in report.reason and "pinning limit" not in report.reason
    check_unpin(report, driver, unregister=driver.unregister)


def test_limit_stops_registration_at_the_right_byte() -> None:
    tensors = _bank()
    p0, p1, _ = _ptrs(tensors)
    driver = FakeDriver()
    report = pin_host_tensors(tensors, limit_bytes=9 * MiB + 123, register=driver.register, chunk_bytes=MiB)
    # 9 MiB + 123 allows tensor 0 and the first MiB of tensor 1; the 123 bytes are less than a page
    assert report.regions == ((p0, 8 * MiB), (p1, MiB)), report.regions
    assert check_report(report, tensors, driver) == [8 * MiB, MiB, 0]
    assert report.pinned_bytes == 9 * MiB and report.pageable_bytes == 5 * MiB
    assert driver.calls_touching(tensors[2]) == [], "registration went on past the limit"
    assert all(ok for _, _, ok in driver.calls), "nothing should be tried that the limit rules out"
    assert f"the pinning limit is {9 * MiB + 123} bytes" in report.reason and "refused" not in report.reason
    check_unpin(report, driver, unregister=driver.unregister)


@pytest.mark.parametrize("limit,whole", [(12 * MiB, 2), (8 * MiB, 1), (0, 0)])
def test_limit_on_a_tensor_boundary_registers_whole_tensors_only(limit: int, whole: int) -> None:
    tensors = _bank()
    driver = FakeDriver()
    report = pin_host_tensors(tensors, limit_bytes=limit, register=driver.register, chunk_bytes=MiB)
    assert report.regions == tuple((t.data_ptr(), t.numel()) for t in tensors[:whole])
    assert [c[:2] for c in driver.calls] == list(report.regions), "a call past the limit"
    assert check_report(report, tensors, driver) == [t.numel() if i < whole else 0 for i, t in enumerate(tensors)]
    assert report.pinned_bytes == limit and "limit" in report.reason


def test_total_failure_pins_nothing_and_says_why() -> None:
    tensors = _bank()
    driver = FakeDriver(budget=0)
    report = pin_host_tensors(tensors, register=driver.register, chunk_bytes=MiB)
    assert report.regions == () and check_report(report, tensors, driver) == [0, 0, 0]
    assert report.pinned_bytes == 0 and report.pageable_bytes == 14 * MiB and "refused" in report.reason
    assert driver.calls and not any(ok for _, _, ok in driver.calls)
    # once the OS keeps refusing, it stops asking instead of trying every chunk of a huge bank
    assert len(driver.calls) <= 3 + pinning.PIN_MAX_FAILED_CHUNKS + 1, driver.calls
    check_unpin(report, driver, unregister=driver.unregister)  # nothing to undo: fine


def test_tensors_sharing_a_page_are_not_registered_twice() -> None:
    # two views into one page-aligned buffer: the second starts inside the first's last page
    a, b = _bank((2 * PAGE + 100, 2 * PAGE - 100), align=PAGE)
    driver = FakeDriver()
    report = pin_host_tensors([a, b], register=driver.register)
    base = a.data_ptr()
    # b's bytes in the shared page are pinned by a's registration; b registers from the next page on
    assert report.regions == ((base, 2 * PAGE + 100), (base + 3 * PAGE, PAGE)), report.regions
    assert check_report(report, [a, b], driver) == [2 * PAGE + 100, 2 * PAGE - 100]
    assert report.pinned_bytes == 4 * PAGE and report.pageable_bytes == 0 and report.reason == ""
    assert all(ok for _, _, ok in driver.calls), "a page was registered twice"
    check_unpin(report, driver, unregister=driver.unregister)


# --------------------------------------------------------------------------- the default (cudaHostRegister) path


@pytest.fixture
def fake_cuda(monkeypatch):
    """pinning's own CUDA calls, answered by a FakeDriver (``driver.budget`` etc. can be set by the test)."""
    driver = FakeDriver()
    cudart = FakeCudart(driver)
    monkeypatch.setattr(pinning, "_has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    return cudart


def test_cuda_path_reads_the_return_code_and_unpins_through_cudart(fake_cuda) -> None:
    driver = fake_cuda.driver
    driver.budget = 9 * MiB
    tensors = _bank()
    p0, p1, _ = _ptrs(tensors)
    report = pin_host_tensors(tensors, chunk_bytes=MiB)
    assert report.method == "cudaHostRegister"
    assert report.regions == ((p0, 8 * MiB), (p1, MiB)), "a nonzero cudaError must read as a refusal"
    assert check_report(report, tensors, driver) == [8 * MiB, MiB, 0]
    assert report.pinned_bytes == 9 * MiB and "refused" in report.reason
    assert set(fake_cuda.flags) == {0}, "cudaHostRegisterDefault"
    check_unpin(report, driver)  # no unregister given: the cudaHostRegister report unpins through cudart


def test_every_refusal_on_the_cuda_path_drains_the_cuda_error(fake_cuda, monkeypatch) -> None:
    # a failed cudaHostRegister leaves the thread's CUDA error set; pinning must consume it each time
    drains = []
    monkeypatch.setattr(pinning, "_drain_cuda_error", lambda: drains.append(len(fake_cuda.driver.calls)))
    fake_cuda.driver.budget = 9 * MiB
    report = pin_host_tensors(_bank(), chunk_bytes=MiB)
    refused_at = [i + 1 for i, (_, _, ok) in enumerate(fake_cuda.driver.calls) if not ok]
    assert refused_at and drains == refused_at, (drains, refused_at)
    unpin(report)
    assert len(drains) == len(refused_at), "a successful unregister needs no drain"
    unpin(report)  # a second time: every unregister fails, and each failure is drained
    assert len(drains) == len(refused_at) + len(report.regions)


def test_can_pin_asks_the_driver_and_leaves_nothing_registered(fake_cuda) -> None:
    driver = fake_cuda.driver
    assert can_pin() is True
    assert len(driver.calls) == 1 and driver.calls[0][1] == PAGE and driver.calls[0][0] % PAGE == 0
    assert driver.locked == {} and driver.unregistered == [driver.calls[0][0]]
    driver.budget = 0
    assert can_pin() is False
    assert driver.locked == {}


def _tiny_bank():
    from moed.cache.bank_builder import build_expert_bank
    from moed.cache.host_bank import ExpertActivation

    gen = torch.Generator().manual_seed(0)
    return build_expert_bank(torch.randn(8, 32, 64, generator=gen), torch.randn(8, 32, 32, generator=gen),
                             num_moe_layers=2, num_experts=4, dtype="fp32", activation=ExpertActivation())


@pytest.fixture
def cuda_executor_factory(monkeypatch, fake_cuda):
    """build_executor believing it has a CUDA device (an emulated one called "cuda") and the fake driver."""
    from moed.devices.emulated import EmulatedDevice
    from moed.experts import executor_factory

    from moed.devices.cuda import CudaDevice

    class FakeCudaDevice(EmulatedDevice):
        kind = "cuda"
        pin_host = CudaDevice.pin_host  # the real CUDA pinning, through the fake driver
        unpin_host = CudaDevice.unpin_host

    real = executor_factory._select_device
    monkeypatch.setattr(executor_factory, "_select_device",
                        lambda name, **opts: FakeCudaDevice(b_p=1e9) if name == "cuda" else real(name, **opts))
    return executor_factory


def test_a_bank_the_driver_refuses_falls_back_to_the_cpu_backend(cuda_executor_factory, fake_cuda) -> None:
    from moed.config import EngineConfig
    from moed.experts.cpu_executor import CpuExecutor

    fake_cuda.driver.budget = 0
    bank = _tiny_bank()
    executor = cuda_executor_factory.build_executor(bank, EngineConfig(device="cuda"))
    assert isinstance(executor, CpuExecutor)
    assert fake_cuda.driver.calls and fake_cuda.driver.accepted() == ()
    assert executor.stats.pinned_bytes == 0 and executor.stats.pageable_bytes == bank.nbytes()
    assert "refused" in executor.stats.pin_note


def test_a_partly_pinned_bank_keeps_the_device_and_reports_the_driver_figures(cuda_executor_factory, fake_cuda) -> None:
    from moed.config import EngineConfig
    from moed.experts.hybrid_executor import HybridExecutor

    driver = fake_cuda.driver
    bank = _tiny_bank()
    tensors = list(bank.tensors.values())
    first = byte_range(tensors[0])
    driver.refuse = lambda p, n: overlap((p, p + n), first) == 0  # only the first bank tensor can be locked
    executor = cuda_executor_factory.build_executor(bank, EngineConfig(device="cuda"))
    try:
        assert isinstance(executor, HybridExecutor)
        assert driver.accepted() == ((first[0], first[1] - first[0]),)
        # the tensor bytes in locked pages: all of tensor 0, and whatever of the others shares its pages
        really = sum(driver.locked_bytes_of(t) for t in tensors)
        assert executor.stats.pinned_bytes == really >= first[1] - first[0]
        assert executor.stats.pageable_bytes == bank.nbytes() - really
        assert "refused" in executor.stats.pin_note
    finally:
        executor.close()


def test_closing_the_executor_unpins_the_bank(cuda_executor_factory, fake_cuda) -> None:
    from moed.config import EngineConfig

    executor = cuda_executor_factory.build_executor(_tiny_bank(), EngineConfig(device="cuda"))
    assert fake_cuda.driver.locked, "nothing was pinned: the test is void"
    executor.close()
    assert fake_cuda.driver.locked == {}, "bank still registered after close"


# --------------------------------------------------------------------------- no CUDA, inputs, memlock


def test_without_cuda_nothing_is_pinned() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-CUDA path is not taken")
    report = pin_host_tensors(_bank())
    assert report == PinReport(0, 14 * MiB, "none", report.reason)
    assert "CUDA" in report.reason
    assert can_pin() is False


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        pin_host_tensors([torch.ones(4, 4).t()], register=FakeDriver().register)
    with pytest.raises(ValueError, match="page size"):
        pin_host_tensors(_bank(), register=FakeDriver().register, chunk_bytes=PAGE + 1)
    with pytest.raises(ValueError, match="limit_bytes"):
        pin_host_tensors(_bank(), register=FakeDriver().register, limit_bytes=-1)
    with pytest.raises(ValueError, match="unregister"):
        unpin(PinReport(1, 0, "custom", "", ((123, 1),)))


def test_memlock_limit_is_the_soft_limit_the_shell_sees(monkeypatch) -> None:
    assert memlock_limit_bytes() == ulimit_l_bytes()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64 * 1024, resource.RLIM_INFINITY))
    assert memlock_limit_bytes() == 64 * 1024, "the soft limit, not the hard one, is what the OS enforces"
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert memlock_limit_bytes() is None


# --------------------------------------------------------------------------- a real GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_real_pinning_registers_host_memory() -> None:
    assert can_pin()
    tensors = [mmap_tensor(16 * MiB), mmap_tensor(MiB), mmap_tensor(3 * PAGE)]
    assert not any(t.is_pinned() for t in tensors)
    report = pin_host_tensors(tensors)
    try:
        assert report.method == "cudaHostRegister"
        assert report.pinned_bytes > 0, report  # a GPU machine that cannot lock 17 MiB is misconfigured
        assert_pinned_as_reported(report, tensors)
    finally:
        unpin(report)
    for t in tensors:
        lo, hi = byte_range(t)
        assert not cuda_is_pinned_at(lo) and not cuda_is_pinned_at(hi - 1), "still pinned after unpin"


@pytest.mark.gpu
@needs_cuda
def test_real_pinning_stops_at_the_limit() -> None:
    tensors = [mmap_tensor(4 * MiB), mmap_tensor(4 * MiB), mmap_tensor(MiB)]
    report = pin_host_tensors(tensors, limit_bytes=6 * MiB + 123, chunk_bytes=MiB)
    try:
        if "refused" in report.reason:
            pytest.skip(f"this machine cannot lock 6 MiB: {report.reason}")
        assert report.pinned_bytes == 6 * MiB, report  # page-aligned tensors: the limit ends on a page boundary
        assert_pinned_as_reported(report, tensors)
        p1 = tensors[1].data_ptr()
        assert cuda_is_pinned_at(p1 + 2 * MiB - 1) and not cuda_is_pinned_at(p1 + 2 * MiB)
        assert not cuda_is_pinned_at(tensors[2].data_ptr())
    finally:
        unpin(report)


@pytest.mark.gpu
@needs_cuda
def test_real_refusal_is_reported_pageable_and_leaves_cuda_usable() -> None:
    a, b = mmap_tensor(MiB), mmap_tensor(MiB)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(b.data_ptr(), MiB, 0)) == 0  # someone else holds b: registering it is refused
    report = pin_host_tensors([a, b], chunk_bytes=MiB)
    later_error = None
    try:
        # a refused cudaHostRegister leaves the thread's CUDA error state set unless it is consumed;
        # the next checked CUDA call (any kernel launch) would then fail with that stale error
        try:
            assert torch.ones(1024, device="cuda").add_(1).sum().item() == 2048
        except RuntimeError as exc:  # the failing call consumed the stale error: later tests are unaffected
            later_error = exc
        assert report.regions == ((a.data_ptr(), MiB),), report
        assert report.pinned_bytes == MiB and report.pageable_bytes == MiB and "refused" in report.reason
        assert a.is_pinned()
    finally:
        unpin(report)
        cudart.cudaHostUnregister(b.data_ptr())
    assert later_error is None, f"a refused pin broke the next unrelated CUDA call: {later_error}"
