"""Experts run from device slots as one grouped computation: the torch code CUDA runs, here on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation, ExpertBank
from moed.devices.emulated import EmulatedDevice
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.cpu_executor import CpuExecutor
from moed.experts.device_ffn import run_grouped_experts
from moed.experts.expert_ffn import run_expert_reference
from moed.experts.hybrid_executor import HybridExecutor
from moed.experts.policies import make_policy

D, I = 64, 96
INT8_ACTIVATION_TOL = 3e-2  # of the output's range: the CPU kernels' int8 activations against float32 ones


def _bank(dtype: str, layers: int = 2, experts: int = 4) -> ExpertBank:
    gen = torch.Generator().manual_seed(0)
    n = layers * experts
    return build_expert_bank(
        torch.randn(n, D, 2 * I, generator=gen) / D**0.5 * 4, torch.randn(n, I, D, generator=gen) / I**0.5,
        num_moe_layers=layers, num_experts=experts, dtype=dtype, activation=ExpertActivation("gpt_oss"),
        gate_up_bias=torch.randn(n, 2 * I, generator=gen), down_bias=torch.randn(n, D, generator=gen),
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "q8", "mxfp4", "int4"])
@pytest.mark.parametrize("tokens", [1, 5, 30])
def test_grouped_slot_path_matches_the_reference(dtype: str, tokens: int) -> None:
    """Several experts with different token counts in one grouped call, against each expert alone."""
    bank = _bank(dtype) if dtype != "int4" else _bank_int4()
    device = EmulatedDevice(b_p=1e9, b_dev=1e12)
    gen = torch.Generator().manual_seed(tokens)
    slot_ids = [5, 0, 3]
    counts = [tokens, 1, 2 * tokens]
    offsets = [0, tokens, tokens + 1, 3 * tokens + 1]
    x = torch.randn(offsets[-1], D, generator=gen)
    got = run_grouped_experts(device, bank, x, slot_ids, offsets)
    for e, slot in enumerate(slot_ids):
        a, b = offsets[e], offsets[e + 1]
        want = run_expert_reference(bank, slot, x[a:b])
        torch.testing.assert_close(got[a:b], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert sum(counts) == got.shape[0]


def _bank_int4(layers: int = 2, experts: int = 4) -> ExpertBank:
    gen = torch.Generator().manual_seed(0)
    n = layers * experts
    return build_expert_bank(torch.randn(n, D, 2 * I, generator=gen) / D**0.5, torch.randn(n, I, D, generator=gen) / I**0.5,
                             num_moe_layers=layers, num_experts=experts, dtype="int4", activation=ExpertActivation())


@pytest.mark.parametrize("dtype", ["q8", "mxfp4"])
def test_emulated_device_runs_block_scaled_slots_like_the_cpu(dtype: str) -> None:
    layers, experts = 2, 8
    bank = _bank(dtype, layers, experts)
    reference = CpuExecutor(bank)
    executor = HybridExecutor(bank, EmulatedDevice(b_p=1e9, b_dev=1e12), num_slots=6,
                              policy=make_policy("adaptive"), bandwidth=BandwidthModel(1e9, 1e9))
    gen = torch.Generator().manual_seed(1)
    try:
        assert {k for k in executor.slots} == set(bank.tensors)
        for call in range(24):
            x = torch.randn(1 + call % 3, D, generator=gen)
            weights, ids = torch.topk(torch.rand(x.shape[0], experts, generator=gen), 2, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            # the slots hold the same bytes; the device's torch code multiplies float32 activations,
            # the native CPU kernels int8-quantised ones (as llama.cpp does): within that rounding
            layer = call % layers
            want = reference.run(layer, x, ids, weights)
            torch.testing.assert_close(executor.run(layer, x, ids, weights), want, rtol=0,
                                       atol=INT8_ACTIVATION_TOL * float(want.abs().max()))
        assert executor.stats.hits + executor.stats.fills > 0
    finally:
        executor.close()
