"""A ggml bank (GGUF block rows as stored) on the device: slots as wide as the widest layer, copies layer by
layer into the start of each slot row, each layer's rows decoded in its own type (issue #31 item 3)."""

from __future__ import annotations

import pytest
import torch

from moed.cache.host_bank import GGML_BANK, ExpertActivation, ExpertBank
from moed.devices.emulated import EmulatedDevice
from moed.experts import ggml_slots
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.cpu_executor import CpuExecutor
from moed.experts.executor_factory import cache_slots_for
from moed.experts.hybrid_executor import HybridExecutor
from moed.experts.kernel_bench import random_rows
from moed.experts.policies import make_policy
from moed.experts.prefill_stream import STREAM_MIN_TOKENS
from moed.kernels.ggml_rows_format import dequantize_rows
from moed.kernels.native_cpu import native
from helpers.native_switch import without_native_kernels

HIDDEN, INTER, EXPERTS = 256, 256, 8
# a Q4_K_M-like mix: Q4_K gate/up, the down Q6_K in some layers; an NVFP4 layer with its per-expert factor
LAYERS = [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K"), ("Q8_0", "IQ4_XS", "Q5_K"), ("NVFP4", "NVFP4", "Q2_K")]


def mixed_bank(bias: bool = False) -> ExpertBank:
    from moed.kernels.gguf_quants import type_id

    gen = torch.Generator().manual_seed(0)
    tensors, types = {}, {}
    for layer, names in enumerate(LAYERS):
        for kind, name, rows, k in zip(ggml_slots.KINDS, names, (INTER, INTER, HIDDEN), (HIDDEN, HIDDEN, INTER)):
            tensors[f"{kind}.{layer}"], types[f"{kind}.{layer}"] = random_rows(name, (EXPERTS, rows), k, gen), type_id(name)
            if name == "NVFP4":
                tensors[f"{kind}.{layer}.scale"] = torch.rand(EXPERTS, generator=gen) + 0.5
    if bias:
        n = len(LAYERS) * EXPERTS
        tensors["gate_up_bias"] = torch.randn(n, 2 * INTER, generator=gen) * 0.1
        tensors["down_bias"] = torch.randn(n, HIDDEN, generator=gen) * 0.1
    return ExpertBank(num_moe_layers=len(LAYERS), num_experts=EXPERTS, hidden_size=HIDDEN, intermediate_size=INTER,
                      dtype=GGML_BANK, activation=ExpertActivation("silu"), tensors=tensors, row_types=types)


def reference_matrix(bank: ExpertBank, kind: str, layer: int, expert: int) -> torch.Tensor:
    """One expert matrix as gguf decodes it, its factor applied to the outputs: float32 ``[rows, k]``."""
    t, ggml_type = bank.ggml_matrix(kind, layer)
    w = dequantize_rows(t[expert], ggml_type, HIDDEN if kind != "down" else INTER)
    scale = bank.ggml_scale(kind, layer)
    return w if scale is None else w * scale[expert]


def test_the_slots_are_as_wide_as_the_widest_layer_and_a_slot_counts_those_bytes():
    bank = mixed_bank(bias=True)
    layout = ggml_slots.slot_layout(bank)
    for kind in ggml_slots.KINDS:
        widest = max(bank.ggml_matrix(kind, layer)[0][0].numel() for layer in range(len(LAYERS)))
        assert layout[kind] == ((widest,), torch.uint8)
    assert layout["gate.scale"] == ((), torch.float32) and "down.scale" not in layout
    assert layout["gate_up_bias"] == ((2 * INTER,), torch.float32)
    slot = sum(layout[k][0][0] for k in ggml_slots.KINDS) + 2 * 4 + 4 * (2 * INTER + HIDDEN)  # + 2 factors, biases
    assert slot > bank.bytes_per_expert()  # the widest, not the average
    assert cache_slots_for(bank, 1.0) == bank.nbytes() // slot < bank.num_slots
    with pytest.raises(ValueError, match="ggml bank"):
        ggml_slots.slot_layout(ExpertBank(1, 1, 32, 32, "bf16", ExpertActivation()))


def test_a_layers_rows_fill_the_start_of_their_slots_and_leave_the_rest():
    bank = mixed_bank()
    device = EmulatedDevice(b_p=float("inf"))
    slots = device.alloc_slots(6, ggml_slots.slot_layout(bank))
    for t in slots.values():
        t.fill_(0xAB if t.dtype == torch.uint8 else 7.0)
    src = ggml_slots.layer_source(bank, 1)  # Q4_K down: narrower than layer 0's Q6_K
    device.copy_rows_async({k: slots[k] for k in src}, [4, 2], src, [5, 3]).wait()
    device.synchronize()
    down, _ = bank.ggml_matrix("down", 1)
    width = down[0].numel()
    assert width < slots["down"].shape[1]
    assert torch.equal(slots["down"][4, :width], down[5].reshape(-1))
    assert torch.equal(slots["down"][2, :width], down[3].reshape(-1))
    assert bool((slots["down"][4, width:] == 0xAB).all()) and bool((slots["down"][0] == 0xAB).all())
    assert bool((slots["gate.scale"] == 7.0).all())  # layer 1 has no factor: nothing written
    wider = {"down": torch.zeros(2, slots["down"].shape[1] + 1, dtype=torch.uint8)}
    with pytest.raises(ValueError, match="slot rows"):
        device.copy_rows_async({"down": slots["down"]}, [0], wider, [0])
    device.close()


@pytest.mark.parametrize("layer", range(len(LAYERS)))
@pytest.mark.parametrize("chunk_bytes", [ggml_slots.DEQUANT_CHUNK_BYTES, 1], ids=["one chunk", "a slot a chunk"])
def test_a_grouped_product_is_x_times_the_gguf_decoded_rows(layer, chunk_bytes, monkeypatch):
    monkeypatch.setattr(ggml_slots, "DEQUANT_CHUNK_BYTES", chunk_bytes)
    bank = mixed_bank()
    device = EmulatedDevice(b_p=float("inf"))
    slots = device.alloc_slots(8, ggml_slots.slot_layout(bank))
    src = ggml_slots.layer_source(bank, layer)
    experts, where = [6, 1, 3, 0], [5, 0, 7, 2]
    device.copy_rows_async({k: slots[k] for k in src}, where, src, experts).wait()
    matrices = ggml_slots.layer_matrices(bank, layer)
    gen = torch.Generator().manual_seed(layer)
    counts = [3, 0, 1, 5]  # an expert with no rows in this call
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    for kind in ggml_slots.KINDS:
        m = matrices[kind]
        x = torch.randn(offsets[-1], m.k, generator=gen)
        got = ggml_slots.grouped_matmul(x, slots, kind, m, where, offsets)
        for e, expert in enumerate(experts):
            a, b = offsets[e], offsets[e + 1]
            want = x[a:b].double() @ reference_matrix(bank, kind, layer, expert).double().T
            if b > a:
                assert torch.allclose(got[a:b].double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    with pytest.raises(ValueError, match="offsets"):
        ggml_slots.grouped_matmul(torch.zeros(2, HIDDEN), slots, "gate", matrices["gate"], [0], [0, 1])
    with pytest.raises(ValueError, match="out of range"):
        ggml_slots.grouped_matmul(torch.zeros(1, HIDDEN), slots, "gate", matrices["gate"], [8], [0, 1])
    device.close()


def _routed(gen: torch.Generator, tokens: int, top_k: int = 2):
    x = torch.randn(tokens, HIDDEN, generator=gen) * 0.5
    weights, ids = torch.topk(torch.rand(tokens, EXPERTS, generator=gen), top_k, dim=-1)
    return x, ids, weights / weights.sum(-1, keepdim=True)


def _decode_calls(executor: HybridExecutor, reference: CpuExecutor, gen: torch.Generator, calls: int, tol: float):
    """``calls`` decode-sized layer calls cycling over the layers, the cache resized half way (its refill spans
    layers): each result the CPU executor's within ``tol`` of its scale."""
    for call in range(calls):
        if call == calls // 2:
            executor.resize(14)
        layer = call % len(LAYERS)
        x, ids, w = _routed(gen, 1 + call % 3)
        got, want = executor.run(layer, x, ids, w), reference.run(layer, x, ids, w)
        assert torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())), (call, layer)


@pytest.mark.parametrize("bias", [False, True])
def test_the_hybrid_executor_runs_a_ggml_bank_as_the_cpu_does(bias):
    """Hits, fills and CPU experts over many layers, a resize (whose refill spans layers) and a long prefill
    streamed through layer buffers: the CPU executor's results. With the native kernels off both sides
    multiply the same float activations by the same decoded rows: equal to float rounding."""
    bank = mixed_bank(bias)
    reference = CpuExecutor(bank)
    device = EmulatedDevice(b_p=float("inf"))
    executor = HybridExecutor(bank, device, num_slots=10, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(16e9, 16e9))
    gen = torch.Generator().manual_seed(1)
    try:
        with without_native_kernels():
            _decode_calls(executor, reference, gen, 24, tol=1e-4)
            executor.begin_step("prefill", [0] * STREAM_MIN_TOKENS, list(range(STREAM_MIN_TOKENS)))
            for layer in range(len(LAYERS)):
                x, ids, w = _routed(gen, STREAM_MIN_TOKENS)
                got, want = executor.run(layer, x, ids, w), reference.run(layer, x, ids, w)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), layer
        stats = executor.stats
        assert stats.hits > 0 and stats.fills > 0 and stats.refill_bytes > 0 and stats.streamed_layers == len(LAYERS)
        assert stats.cache_bytes == stats.cache_slots * executor.slot_bytes
    finally:
        executor.close()


def test_with_the_native_kernels_the_cpu_share_differs_only_by_int8_activations():
    if native() is None:
        pytest.skip("the native CPU kernels are not built")
    bank = mixed_bank()
    reference = CpuExecutor(bank)
    executor = HybridExecutor(bank, EmulatedDevice(b_p=float("inf")), num_slots=6, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(16e9, 16e9))
    gen = torch.Generator().manual_seed(2)
    try:
        for call in range(16):
            x, ids, w = _routed(gen, 2)
            got, want = executor.run(call % len(LAYERS), x, ids, w), reference.run(call % len(LAYERS), x, ids, w)
            assert float((got - want).abs().max() / want.abs().max()) < 3e-2, call
        assert executor.stats.hits + executor.stats.fills > 0
    finally:
        executor.close()


def test_moed_bench_bw_calibrates_on_a_ggml_bank():
    """The calibration copies (per layer) and CPU passes (a call per layer) work on a ggml bank: both rates
    measured, the slots freed."""
    from moed.devices.emulated import emulated_device_bytes
    from moed.experts.calibration import calibrate

    bank = mixed_bank()
    device = EmulatedDevice(b_p=2e9)
    before = emulated_device_bytes()
    profile = calibrate(device, bank, seconds=0.05, num_slots=6)
    assert profile.b_p > 0 and profile.b_h > 0 and profile.b_p_concurrent > 0
    assert profile.expert_shape.endswith("ggml") and emulated_device_bytes() == before
    device.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_slots_give_the_cpu_executors_results():
    """The same code on a GPU: prefix copies from the (pinned) bank on the transfer stream, each layer's rows
    decoded by the torch decoders on the device, the CPU executor's results (torch path on both sides)."""
    from moed.devices import CudaDevice

    bank = mixed_bank(bias=True)
    device = CudaDevice()
    report = device.pin_host(bank.storage())
    reference = CpuExecutor(bank)
    executor = HybridExecutor(bank, device, num_slots=10, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(16e9, 16e9), on_close=lambda: device.unpin_host(report))
    gen = torch.Generator().manual_seed(3)
    try:
        with without_native_kernels():
            _decode_calls(executor, reference, gen, 16, tol=1e-3)
        assert executor.stats.hits > 0 and executor.stats.fills > 0
    finally:
        executor.close()
