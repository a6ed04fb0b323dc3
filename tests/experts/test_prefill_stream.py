"""Streamed prefill: whole layers through two buffers (or one, on demand), the same results, the fallbacks."""

from __future__ import annotations

import pytest
import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.devices.emulated import EmulatedDevice
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.cpu_executor import CpuExecutor
from moed.experts.hybrid_executor import HybridExecutor
from moed.experts.policies import make_policy
from moed.experts.prefill_stream import STREAM_MIN_TOKENS, stream_buffers

LAYERS, EXPERTS, D, I, TOP_K = 4, 8, 64, 96, 2


def _bank(dtype: str = "fp32"):
    gen = torch.Generator().manual_seed(0)
    n = LAYERS * EXPERTS
    return build_expert_bank(torch.randn(n, D, 2 * I, generator=gen) * 0.1, torch.randn(n, I, D, generator=gen) * 0.1,
                             num_moe_layers=LAYERS, num_experts=EXPERTS, dtype=dtype, activation=ExpertActivation())


def _routing(gen: torch.Generator, tokens: int):
    x = torch.randn(tokens, D, generator=gen)
    weights, ids = torch.topk(torch.rand(tokens, EXPERTS, generator=gen), TOP_K, dim=-1)
    return x, ids, weights / weights.sum(-1, keepdim=True)


class RecordingDevice(EmulatedDevice):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple] = []

    def copy_rows_async(self, dst, dst_slots, src, src_rows, **kw):
        self.log.append(("copy", min(src_rows) // EXPERTS, len(src_rows)))
        return super().copy_rows_async(dst, dst_slots, src, src_rows, **kw)

    def wait_copy(self, handle) -> None:
        self.log.append(("wait_copy",))
        super().wait_copy(handle)

    def enqueue(self, work) -> None:
        self.log.append(("enqueue",))
        super().enqueue(work)


def _prefill(executor, reference, tokens: int, gen: torch.Generator) -> None:
    """One prefill step over every layer, each layer's output against the CPU executor's."""
    executor.begin_step("prefill", [0] * tokens, list(range(tokens)))
    for layer in range(LAYERS):
        x, ids, w = _routing(gen, tokens)
        got = executor.run(layer, x, ids, w)
        want = reference.run(layer, x, ids, w)
        # a quantised bank's CPU kernels use int8 activations, the device's torch code float32 ones
        tol = 1e-5 if executor.bank.dtype in ("fp32", "bf16") else 3e-2
        torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_double_buffered_prefill_loads_the_next_layer_before_this_one_computes(dtype: str) -> None:
    bank = _bank(dtype)
    device = RecordingDevice(b_p=5e9)
    executor = HybridExecutor(bank, device, num_slots=3 * EXPERTS, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(5e9, 5e9))
    gen = torch.Generator().manual_seed(1)
    try:
        _prefill(executor, CpuExecutor(bank), STREAM_MIN_TOKENS, gen)
        copies = [entry for entry in device.log if entry[0] == "copy"]
        assert copies == [("copy", layer, EXPERTS) for layer in range(LAYERS)], copies  # whole layers, in order
        # layer l+1's copy is queued before layer l waits for its own and computes
        for layer in range(LAYERS - 1):
            at = device.log.index(("copy", layer + 1, EXPERTS))
            assert device.log[at + 1] == ("wait_copy",), device.log
        assert executor.stats.streamed_layers == LAYERS
        assert executor.stats.streamed_bytes == LAYERS * EXPERTS * bank.bytes_per_expert()
        assert executor.cache.num_slots == 3 * EXPERTS - 2 * EXPERTS  # the cache gave two layers up

        # a decode step gives the buffers back, and decode runs through the split policy again
        x, ids, w = _routing(gen, 1)
        executor.begin_step("decode", [0], [STREAM_MIN_TOKENS])
        want = CpuExecutor(bank).run(0, x, ids, w)
        tol = 1e-5 if dtype == "fp32" else 3e-2  # int4: the CPU kernels' int8 activations
        torch.testing.assert_close(executor.run(0, x, ids, w), want, rtol=0, atol=tol * float(want.abs().max()))
        assert executor.cache.num_slots + executor.num_scratch == 3 * EXPERTS
        assert executor.stats.streamed_layers == LAYERS
    finally:
        executor.close()


def test_room_for_one_layer_loads_each_layer_on_demand_after_its_routing() -> None:
    bank = _bank()
    device = RecordingDevice(b_p=5e9)
    executor = HybridExecutor(bank, device, num_slots=EXPERTS + 3, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(5e9, 5e9))
    gen = torch.Generator().manual_seed(2)
    try:
        _prefill(executor, CpuExecutor(bank), STREAM_MIN_TOKENS, gen)
        copies = [entry for entry in device.log if entry[0] == "copy"]
        assert [layer for _, layer, _ in copies] == list(range(LAYERS)), copies  # one load per layer, when it runs
        assert executor.stats.streamed_layers == LAYERS
    finally:
        executor.close()


def test_less_than_a_layer_or_a_short_prefill_takes_the_split_policy() -> None:
    bank = _bank()
    gen = torch.Generator().manual_seed(3)
    for num_slots, tokens in ((EXPERTS - 1, STREAM_MIN_TOKENS), (3 * EXPERTS, STREAM_MIN_TOKENS - 1)):
        executor = HybridExecutor(bank, EmulatedDevice(b_p=5e9), num_slots=num_slots, policy=make_policy("adaptive"),
                                  bandwidth=BandwidthModel(5e9, 5e9))
        try:
            _prefill(executor, CpuExecutor(bank), tokens, gen)
            assert executor.stats.streamed_layers == 0
            assert executor.stats.hits + executor.stats.misses > 0
        finally:
            executor.close()


def test_a_resize_in_the_middle_of_a_streamed_prefill_ends_the_stream_and_keeps_results() -> None:
    bank = _bank()
    executor = HybridExecutor(bank, EmulatedDevice(b_p=5e9), num_slots=3 * EXPERTS, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(5e9, 5e9))
    gen = torch.Generator().manual_seed(4)
    reference = CpuExecutor(bank)
    try:
        _prefill(executor, reference, STREAM_MIN_TOKENS, gen)
        executor.resize(EXPERTS + 2)  # the memory governor shrank the budget between two steps
        assert executor.cache.num_slots + executor.num_scratch == EXPERTS + 2
        _prefill(executor, reference, STREAM_MIN_TOKENS, gen)  # now on demand: one layer fits
        assert executor.stats.streamed_layers == 2 * LAYERS
    finally:
        executor.close()


def test_stream_buffers_refuses_other_counts_and_fits_the_pool() -> None:
    assert stream_buffers(16, 8, 2) == 2 and stream_buffers(15, 8, 2) == 1 and stream_buffers(7, 8, 2) == 0
    assert stream_buffers(16, 8, 1) == 1
    with pytest.raises(ValueError, match="1 .*or 2"):
        stream_buffers(16, 8, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("buffers", [2, 1])
def test_streamed_prefill_on_cuda_matches_the_cpu(buffers: int) -> None:
    from moed.devices.cuda import CudaDevice
    from moed.devices.pinning import pin_host_tensors, unpin

    bank = _bank("int4")
    report = pin_host_tensors(list(bank.tensors.values()))
    executor = HybridExecutor(bank, CudaDevice(), num_slots=2 * EXPERTS, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(20e9, 20e9), prefill_buffers=buffers)
    try:
        _prefill(executor, CpuExecutor(bank), STREAM_MIN_TOKENS, torch.Generator().manual_seed(5))
        assert executor.stats.streamed_layers == LAYERS
    finally:
        executor.close()
        unpin(report)
