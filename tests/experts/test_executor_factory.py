"""Executor choice: cache sizing from a byte budget, and the CPU-only fallback when nothing can be pinned."""

from __future__ import annotations

import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.config import EngineConfig
from moed.devices.emulated import EmulatedDevice
from moed.devices.pinning import PinReport
from moed.experts import executor_factory
from moed.experts.cpu_executor import CpuExecutor
from moed.experts.hybrid_executor import HybridExecutor


def tiny_bank():
    gen = torch.Generator().manual_seed(0)
    return build_expert_bank(torch.randn(8, 32, 64, generator=gen), torch.randn(8, 32, 32, generator=gen),
                             num_moe_layers=2, num_experts=4, dtype="fp32", activation=ExpertActivation())


class FakeCudaDevice(EmulatedDevice):
    """Stands in for a CUDA device so the pinning decision can be exercised without a GPU."""

    kind = "cuda"
    report: PinReport | None = None  # what pin_host answers
    unpinned: list = []

    def pin_host(self, tensors):
        return self.report

    def unpin_host(self, report):
        FakeCudaDevice.unpinned.append(report)


REAL_SELECT = executor_factory._select_device


def fake_select(name, **opts):
    return FakeCudaDevice(b_p=1e9) if name == "cuda" else REAL_SELECT(name, **opts)


def test_nothing_pinnable_falls_back_to_the_cpu_backend(monkeypatch):
    bank = tiny_bank()
    monkeypatch.setattr(executor_factory, "_select_device", fake_select)
    monkeypatch.setattr(FakeCudaDevice, "report", PinReport(
        0, bank.nbytes(), "cudaHostRegister", "RLIMIT_MEMLOCK is 8 MiB"))
    executor = executor_factory.build_executor(bank, EngineConfig(device="cuda"))
    assert isinstance(executor, CpuExecutor)
    assert executor.stats.pinned_bytes == 0 and executor.stats.pageable_bytes == bank.nbytes()
    assert "MEMLOCK" in executor.stats.pin_note


def test_partial_pinning_keeps_the_hybrid_engine_and_reports_it(monkeypatch):
    bank = tiny_bank()
    monkeypatch.setattr(executor_factory, "_select_device", fake_select)
    half = bank.nbytes() // 2
    report = PinReport(half, bank.nbytes() - half, "cudaHostRegister", "pinned what the memlock limit allows")
    monkeypatch.setattr(FakeCudaDevice, "report", report)
    monkeypatch.setattr(FakeCudaDevice, "unpinned", [])
    executor = executor_factory.build_executor(bank, EngineConfig(device="cuda", cache_fraction=0.5))
    try:
        assert isinstance(executor, HybridExecutor)
        assert executor.stats.pinned_bytes == half and executor.stats.pageable_bytes == bank.nbytes() - half
        assert executor.stats.cache_slots == 4  # half of 8 experts fit the byte budget
    finally:
        executor.close()
    assert FakeCudaDevice.unpinned == [report]  # closing released the pinning


def test_cache_slots_follow_the_byte_budget():
    bank = tiny_bank()
    assert executor_factory.cache_slots_for(bank, 0.0) == 0
    assert executor_factory.cache_slots_for(bank, 0.26) == 2
    assert executor_factory.cache_slots_for(bank, 1.0) == 8


def test_asking_for_cuda_without_one_is_a_clear_request_error():
    import pytest
    import torch as _torch

    from moed.errors import InvalidRequestError

    if _torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidRequestError, match="CUDA"):
        executor_factory.build_executor(tiny_bank(), EngineConfig(device="cuda"))
