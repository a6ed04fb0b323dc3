"""One host sync per MoE layer, counted on the emulated device; device work queued in stream order.

The emulated device runs the executor's device work only when the host syncs (``to_host``,
``synchronize``) or flushes, as a CUDA stream runs launched work in its own time, so a result
read too early, or a sync too many, shows here without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import build_tiny_model
from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.config import EngineConfig
from moed.devices.emulated import EmulatedDevice
from moed.engine.runtime import open_runtime
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.cpu_executor import CpuExecutor
from moed.experts.hybrid_executor import HybridExecutor
from moed.experts.policies import make_policy
from moed.runner.forward_batch import ForwardBatch

LAYERS, EXPERTS, D, I = 3, 16, 64, 96


def _bank(dtype: str = "fp32"):
    gen = torch.Generator().manual_seed(0)
    n = LAYERS * EXPERTS
    return build_expert_bank(torch.randn(n, D, 2 * I, generator=gen) * 0.1, torch.randn(n, I, D, generator=gen) * 0.1,
                             num_moe_layers=LAYERS, num_experts=EXPERTS, dtype=dtype, activation=ExpertActivation())


def _call(gen: torch.Generator, tokens: int, top_k: int = 4):
    x = torch.randn(tokens, D, generator=gen)
    weights, ids = torch.topk(torch.rand(tokens, EXPERTS, generator=gen), top_k, dim=-1)
    return x, ids, weights / weights.sum(-1, keepdim=True)


class RecordingDevice(EmulatedDevice):
    """The emulated device, logging the executor's calls in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[str] = []

    def copy_rows_async(self, *args, **kwargs):
        self.log.append("copy")
        return super().copy_rows_async(*args, **kwargs)

    def enqueue(self, work) -> None:
        self.log.append("enqueue")
        super().enqueue(work)

    def wait_copy(self, handle) -> None:
        self.log.append("wait_copy")
        super().wait_copy(handle)

    def to_host(self, *tensors):
        self.log.append("to_host")
        return super().to_host(*tensors)


def _device(kind: str):
    if kind == "emulated":
        return EmulatedDevice(b_p=2e9, b_dev=1e12)
    from moed.devices.cuda import CudaDevice

    return CudaDevice()


DEVICES = ["emulated", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device_kind", DEVICES)
@pytest.mark.parametrize("policy", ["adaptive", "fill-all", "cpu-all", "lru-freq"])
@pytest.mark.parametrize("model_on_device", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_one_host_sync_per_layer_call(policy: str, model_on_device: bool, dtype: str, device_kind: str) -> None:
    """The whole HybridExecutor path on each device: results, and one host sync per layer call."""
    bank = _bank(dtype)
    reference = CpuExecutor(bank)
    device = _device(device_kind)
    if device_kind == "cuda":
        from moed.devices.pinning import pin_host_tensors, unpin

        report = pin_host_tensors(list(bank.tensors.values()))
    executor = HybridExecutor(bank, device, num_slots=10, policy=make_policy(policy),
                              bandwidth=BandwidthModel(2e9, 4e9), model_on_device=model_on_device)
    gen = torch.Generator().manual_seed(7)
    on = device.compute_device if model_on_device else torch.device("cpu")
    try:
        for call in range(24):
            x, ids, w = _call(gen, 1 + call % 4)
            before = device.stats().host_syncs
            got = executor.run(call % LAYERS, x.to(on), ids.to(on), w.to(on))
            assert device.stats().host_syncs - before == 1, f"call {call}: host syncs per layer call"
            assert got.device == on
            want = reference.run(call % LAYERS, x, ids, w)
            # int4: the CPU branch's kernels use int8 activations, the device's torch code float32 ones
            tol = (1e-5 if device_kind == "emulated" else 1e-4) if dtype == "fp32" else 3e-2
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=tol * float(want.abs().max()))
        stats = executor.stats
        if policy != "cpu-all":
            assert stats.fills > 0
        if policy != "fill-all":
            assert stats.cpu_experts > 0
        if policy != "cpu-all":  # device experts ran: charged by the timing model, or measured by CUDA events
            device.synchronize()
            assert device.stats().compute_seconds > 0 and stats.device_compute_seconds > 0
    finally:
        executor.close()
        if device_kind == "cuda":
            unpin(report)


def test_hits_are_queued_before_the_wait_for_the_fills_copies() -> None:
    bank = _bank()
    device = RecordingDevice(b_p=1e9, b_dev=1e12)
    executor = HybridExecutor(bank, device, num_slots=8, policy=make_policy("fill-all"),
                              bandwidth=BandwidthModel(1e9, 1e9))
    x = torch.randn(1, D)
    w = torch.tensor([[0.6, 0.4]])
    try:
        executor.run(0, x, torch.tensor([[1, 2]]), w)  # fills 1 and 2
        device.log.clear()
        out = executor.run(0, x, torch.tensor([[1, 3]]), w)  # 1 hits, 3 fills
        log = device.log
        assert log.index("copy") < log.index("enqueue") < log.index("wait_copy"), log
        assert log.count("enqueue") >= 3 and log[-1] == "to_host", log  # hits, fills, merge; then the one sync
        assert executor.stats.hits == 1 and executor.stats.fills == 3
        torch.testing.assert_close(out, CpuExecutor(bank).run(0, x, torch.tensor([[1, 3]]), w))
    finally:
        executor.close()


def test_queued_work_runs_in_order_at_the_sync_and_a_failure_loses_nothing_after() -> None:
    device = EmulatedDevice(b_p=1e9)
    seen: list[int] = []
    device.enqueue(lambda: seen.append(1))
    device.enqueue(lambda: seen.append(2))
    assert seen == []  # queued: nothing has run
    device.to_host(torch.zeros(1))
    assert seen == [1, 2] and device.stats().host_syncs == 1

    def boom() -> None:
        raise RuntimeError("kernel failed")

    device.enqueue(boom)
    device.enqueue(lambda: seen.append(3))
    with pytest.raises(RuntimeError, match="kernel failed"):
        device.flush()
    device.enqueue(lambda: seen.append(4))  # the device keeps working; the failed batch is dropped
    device.synchronize()
    assert seen == [1, 2, 4]


def test_a_decode_step_of_a_model_syncs_once_per_moe_layer_and_once_for_the_logits(tmp_path) -> None:
    """The model on the device: each MoE layer downloads its routing ids (one sync), the step its logits."""
    build_tiny_model("qwen3_moe", tmp_path)
    runtime = open_runtime(tmp_path, engine=EngineConfig(device="emulated", cache_fraction=0.5, policy="adaptive",
                                                         emulated_b_p=50e9))
    try:
        model, device = runtime.model, runtime.executor.device
        moe_layers = runtime.executor.bank.num_moe_layers
        cache = model.new_cache(2, 64)
        logits = model.forward(ForwardBatch.from_token_lists([[5, 9, 11], [7, 3]], [0, 0], [0, 1]), cache)
        for step in range(4):
            feed = [[int(t)] for t in logits.argmax(-1)]
            before = device.stats().host_syncs
            logits = model.forward(ForwardBatch.from_token_lists(feed, [3 + step, 2 + step], [0, 1]), cache)
            assert device.stats().host_syncs - before == moe_layers + 1, f"decode step {step}"
        assert runtime.executor.model_on_device and model.device is device
        assert runtime.executor.stats.hits + runtime.executor.stats.fills > 0
    finally:
        runtime.close()


def test_the_model_lives_on_the_device_and_can_be_kept_on_the_host(tmp_path) -> None:
    """Device mode books the non-expert weights and the KV cache as device memory and runs the layers'
    torch code; EngineConfig(model_on_device=False) keeps the
    model on the host, with one sync per MoE layer for the result."""
    from moed.devices.emulated import EmulatedDevice

    build_tiny_model("qwen3_moe", tmp_path)
    on = open_runtime(tmp_path, engine=EngineConfig(device="emulated", cache_fraction=0.5, emulated_b_p=50e9))
    off = open_runtime(tmp_path, engine=EngineConfig(device="emulated", cache_fraction=0.5, emulated_b_p=50e9,
                                                     model_on_device=False))
    try:
        dev = on.executor.device
        assert isinstance(dev, EmulatedDevice) and on.model.device is dev and off.model.device is None
        weights = sum(t.numel() * t.element_size() for t in on.loaded.weights.values())
        slots = dev._ledger.allocated
        cache = on.model.new_cache(2, 64)
        assert dev._ledger.allocated == slots + cache.nbytes()
        assert on.executor.stats.model_device_bytes == weights + cache.nbytes() > 0
        batch = ForwardBatch.from_token_lists([[5, 9, 11], [7, 3]], [0, 0], [0, 1])
        want = off.model.forward(batch, off.model.new_cache(2, 64))
        got = on.model.forward(batch, cache)
        assert got.device.type == "cpu" and not off.executor.model_on_device
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    finally:
        on.close()
        off.close()


def test_torch_paths_hide_the_native_kernels_from_this_thread_only() -> None:
    import threading

    from moed.kernels.native_cpu import native, torch_paths

    outside = native()
    seen = []
    with torch_paths():
        assert native() is None
        with torch_paths():
            assert native() is None
        assert native() is None
        worker = threading.Thread(target=lambda: seen.append(native()))  # the CPU branch's threads keep it
        worker.start()
        worker.join()
    assert native() is outside and seen == [outside]


def test_a_failing_cpu_branch_fails_its_call_only_and_leaves_no_queued_work() -> None:
    bank = _bank()
    device = EmulatedDevice(b_p=2e9)
    executor = HybridExecutor(bank, device, num_slots=10, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(2e9, 4e9))
    reference = CpuExecutor(bank)
    gen = torch.Generator().manual_seed(9)
    real = executor._run_cpu
    failures = iter([True])

    def flaky(*args):
        if next(failures, False):
            raise RuntimeError("CPU kernel failed")
        return real(*args)

    executor._run_cpu = flaky
    try:
        for _ in range(3):  # warm the cache so the failing call also has device work queued
            x, ids, w = _call(gen, 3)
            executor._run_cpu = real
            executor.run(0, x, ids, w)
        executor._run_cpu = flaky
        x, ids, w = _call(gen, 3)
        with pytest.raises(RuntimeError, match="CPU kernel failed"):
            while True:  # the first call that has a CPU branch fails
                executor.run(0, x, ids, w)
                x, ids, w = _call(gen, 3)
        assert device._work == []  # nothing of the failed call is left to run into the next one
        for layer in range(LAYERS):
            x, ids, w = _call(gen, 2)
            want = reference.run(layer, x, ids, w)
            torch.testing.assert_close(executor.run(layer, x, ids, w), want, rtol=0,
                                       atol=1e-5 * float(want.abs().max()))
    finally:
        executor.close()
