"""Experts run from q8 / mxfp4 device slots: the torch (CUDA) path on CPU tensors, and the emulated device."""

from __future__ import annotations

import pytest
import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation, ExpertBank
from moed.devices.emulated import EmulatedDevice
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.cpu_executor import CpuExecutor
from moed.experts.device_ffn import run_slot_expert
from moed.experts.expert_ffn import run_expert_reference
from moed.experts.hybrid_executor import HybridExecutor
from moed.experts.policies import make_policy

D, I = 64, 96


def _bank(dtype: str, layers: int = 2, experts: int = 4) -> ExpertBank:
    gen = torch.Generator().manual_seed(0)
    n = layers * experts
    return build_expert_bank(
        torch.randn(n, D, 2 * I, generator=gen) / D**0.5 * 4, torch.randn(n, I, D, generator=gen) / I**0.5,
        num_moe_layers=layers, num_experts=experts, dtype=dtype, activation=ExpertActivation("gpt_oss"),
        gate_up_bias=torch.randn(n, 2 * I, generator=gen), down_bias=torch.randn(n, D, generator=gen),
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "q8", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 5, 30])
def test_torch_slot_path_matches_the_reference(dtype: str, tokens: int) -> None:
    """The path CUDA slots take (torch ops, weights dequantised on the slots' device), here on CPU tensors."""
    bank = _bank(dtype)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(tokens))
    for slot in (0, 5):
        got = run_slot_expert(bank, slot, x, on_cuda=True)
        want = run_expert_reference(bank, slot, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", ["q8", "mxfp4"])
def test_emulated_device_runs_block_scaled_slots_exactly_like_the_cpu(dtype: str) -> None:
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
            # exact: the emulated slots hold the same bytes and run the same numba kernel
            layer = call % layers
            assert torch.equal(executor.run(layer, x, ids, weights), reference.run(layer, x, ids, weights))
        assert executor.stats.hits + executor.stats.fills > 0
    finally:
        executor.close()
