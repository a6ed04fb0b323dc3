"""HybridExecutor under many steps, concurrent branches and resizes: no deadlock, the CPU executor's results."""

from __future__ import annotations

import threading

import pytest

import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.devices.emulated import EmulatedDevice
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.cpu_executor import CpuExecutor
from moed.experts.hybrid_executor import HybridExecutor
from moed.experts.policies import make_policy


def random_bank(layers: int, experts: int, hidden: int, inter: int, dtype: str = "fp32"):
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(layers * experts, hidden, 2 * inter, generator=gen) * 0.1
    down = torch.randn(layers * experts, inter, hidden, generator=gen) * 0.1
    return build_expert_bank(gate_up, down, num_moe_layers=layers, num_experts=experts, dtype=dtype,
                             activation=ExpertActivation())


def routed_call(gen: torch.Generator, experts: int, tokens: int, top_k: int, hidden: int):
    hidden_states = torch.randn(tokens, hidden, generator=gen)
    scores = torch.rand(tokens, experts, generator=gen)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return hidden_states, ids, weights / weights.sum(-1, keepdim=True)


def test_many_steps_with_resizes_match_the_cpu_executor_and_never_deadlock():
    layers, experts, hidden, inter = 4, 16, 64, 64
    bank = random_bank(layers, experts, hidden, inter, dtype="int4")
    reference = CpuExecutor(bank)
    device = EmulatedDevice(b_p=100e6, b_dev=1e12)  # a slow link: copies overlap the CPU branch
    executor = HybridExecutor(bank, device, num_slots=12, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(100e6, 1e9))
    failures: list[str] = []
    sizes = [12, 4, 0, 20, 64, 7, 12]

    def work() -> None:
        gen = torch.Generator().manual_seed(1)
        for call in range(400):
            if call % 57 == 0:
                executor.resize(sizes[(call // 57) % len(sizes)])  # a safe point between calls
            layer = call % layers
            tokens = 1 + (call % 5)
            x, ids, w = routed_call(gen, experts, tokens, 4, hidden)
            got = executor.run(layer, x, ids, w)
            want = reference.run(layer, x, ids, w)
            # device experts run the device's torch code on float32 activations, the CPU branch the
            # native int4 kernels on int8-quantised ones (as llama.cpp does): within that rounding
            err = float((got - want).abs().max() / want.abs().max())
            if err > 3e-2:
                failures.append(f"call {call}: outputs differ by {err:.2e} of their range")
                return

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout=120)
    executor.close()
    assert not worker.is_alive(), "executor deadlocked or stalled"
    assert not failures, failures[0]
    stats = executor.stats
    assert stats.hits > 0 and stats.fills > 0 and stats.cpu_experts > 0
    assert stats.misses == stats.fills + stats.transient_fills + stats.cpu_experts


def test_bandwidth_estimates_follow_the_real_link():
    bank = random_bank(2, 8, 256, 256)  # ~0.8 MB per expert: big enough samples
    device = EmulatedDevice(b_p=200e6, b_dev=1e12)
    model = BandwidthModel(10e9, 10e9, alpha=0.3)  # start far off
    executor = HybridExecutor(bank, device, num_slots=4, policy=make_policy("fill-all"), bandwidth=model)
    gen = torch.Generator().manual_seed(2)
    try:
        for call in range(30):
            x, ids, w = routed_call(gen, 8, 2, 2, 256)
            executor.run(call % 2, x, ids, w)
    finally:
        executor.close()
    assert model.num_samples_p > 5
    assert 100e6 < model.b_p < 400e6, f"B_P estimate {model.b_p / 1e6:.0f} MB/s, link is 200 MB/s"


def test_resize_frees_the_old_slots_before_taking_new_ones_and_refills_the_kept_from_the_bank():
    # under VRAM pressure there is no room for old and new slot storage at once (seen on an H200: another
    # process holding all but 1 GiB); the kept entries come back from the host bank, which is complete
    layers, experts, hidden, inter = 2, 8, 64, 64
    bank = random_bank(layers, experts, hidden, inter)
    reference = CpuExecutor(bank)
    device = EmulatedDevice(b_p=1e9, b_dev=1e12)
    executor = HybridExecutor(bank, device, num_slots=10, policy=make_policy("fill-all"),
                              bandwidth=BandwidthModel(1e9, 1e9))
    held_when_allocating: list[int] = []
    alloc = device.alloc_slots

    def spy(num_slots, layout):
        held_when_allocating.append(device._ledger.allocated)
        return alloc(num_slots, layout)

    device.alloc_slots = spy
    gen = torch.Generator().manual_seed(3)

    def check(calls: int) -> None:
        for call in range(calls):
            x, ids, w = routed_call(gen, experts, 3, 2, hidden)
            got, want = executor.run(call % layers, x, ids, w), reference.run(call % layers, x, ids, w)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"call {call}"

    try:
        check(12)
        assert executor.cache.num_resident == 10
        executor.resize(4)
        assert executor.cache.num_resident == 4
        assert executor.stats.refill_bytes == 4 * bank.bytes_per_expert()
        check(6)  # the refilled slots hold the right experts (the copies land before the compute reads them)
        kept = executor.cache.num_resident
        executor.resize(12)
        assert executor.stats.refill_bytes == (4 + kept) * bank.bytes_per_expert()
        check(6)
        assert held_when_allocating == [0, 0], held_when_allocating  # the old storage was gone each time
    finally:
        executor.close()


def test_resize_to_the_same_size_moves_nothing_and_no_room_leaves_a_working_executor_without_a_cache():
    from moed.devices.device import DeviceMemoryError

    layers, experts, hidden, inter = 2, 8, 64, 64
    bank = random_bank(layers, experts, hidden, inter)
    reference = CpuExecutor(bank)
    device = EmulatedDevice(b_p=1e9, b_dev=1e12)
    executor = HybridExecutor(bank, device, num_slots=6, policy=make_policy("fill-all"),
                              bandwidth=BandwidthModel(1e9, 1e9))
    gen = torch.Generator().manual_seed(4)

    def check(calls: int) -> None:
        for call in range(calls):
            x, ids, w = routed_call(gen, experts, 3, 2, hidden)
            got, want = executor.run(call % layers, x, ids, w), reference.run(call % layers, x, ids, w)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"call {call}"

    try:
        check(8)
        slots = executor.slots
        executor.resize(6)
        assert executor.slots is slots and executor.stats.refill_bytes == 0  # same size: same storage
        alloc = device.alloc_slots

        def no_room(num_slots, layout):
            raise DeviceMemoryError("emulated: no room")

        device.alloc_slots = no_room
        with pytest.raises(DeviceMemoryError):
            executor.resize(4)
        assert executor.slots == {} and executor.cache.num_slots == 0 and executor.stats.cache_slots == 0
        check(4)  # every miss on the CPU: slower, same results
        device.alloc_slots = alloc
        executor.resize(5)  # a later budget grows it again
        assert executor.cache.num_slots == 5
        check(6)
        assert executor.cache.num_resident > 0
    finally:
        executor.close()
