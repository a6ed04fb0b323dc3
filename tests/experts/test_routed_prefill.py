"""Prefill of quantised banks through the native int8 strips (experts/routed_ffn.py,
kernels/prefill_gemm.native_prefill): which path runs, and that its results are the twin's."""

from __future__ import annotations

import pytest
import torch

import moed.experts.cpu_executor as cpu_executor_module
import moed.experts.routed_ffn as routed_ffn
from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.experts.cpu_executor import CpuExecutor
from moed.kernels import prefill_gemm
from moed.kernels.native_cpu import MAX_TOKENS, descriptor_of, native
from moed.kernels.native_cpu_reference import routed_reference

D, I, EXPERTS, TOP_K = 64, 96, 4, 2
needs_native = pytest.mark.skipif(native() is None, reason="native CPU kernels not built")


def _bank(dtype: str):
    gen = torch.Generator().manual_seed(1)
    return build_expert_bank(torch.randn(EXPERTS, D, 2 * I, generator=gen) / D**0.5,
                             torch.randn(EXPERTS, I, D, generator=gen) / I**0.5,
                             num_moe_layers=1, num_experts=EXPERTS, dtype=dtype, activation=ExpertActivation())


def _routing(tokens: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    return x, ids, torch.rand(tokens, TOP_K, generator=gen)


def test_the_policy_is_for_quantised_banks_and_follows_the_cpu_or_the_override(monkeypatch):
    monkeypatch.delenv("MOED_PREFILL_INT8", raising=False)
    native_bf16 = prefill_gemm._cpu_runs_natively(torch.bfloat16)
    assert prefill_gemm.native_prefill("int4") is (not native_bf16)
    for dtype in ("fp32", "bf16", "q8", "mxfp4"):
        assert prefill_gemm.native_prefill(dtype) is False
    monkeypatch.setenv("MOED_PREFILL_INT8", "1")
    assert prefill_gemm.native_prefill("q8") and prefill_gemm.native_prefill("mxfp4")
    assert not prefill_gemm.native_prefill("bf16")
    monkeypatch.setenv("MOED_PREFILL_INT8", "off")
    assert not prefill_gemm.native_prefill("int4")
    monkeypatch.setenv("MOED_PREFILL_INT8", "maybe")
    with pytest.raises(ValueError, match="MOED_PREFILL_INT8='maybe': use 1"):
        prefill_gemm.native_prefill("int4")


@needs_native
@pytest.mark.parametrize("dtype", ["int4", "q8", "mxfp4"])
def test_a_long_prompt_runs_natively_in_calls_of_bounded_size_and_matches_the_twin(dtype, monkeypatch):
    """300 tokens (two native calls of at most PREFILL_TOKENS; every expert gets far more than the
    strips' 64-token chunks): never the per-expert path, within the twin's bound, and the same bits
    as one native call over all tokens (the cut into calls does not change a result)."""
    monkeypatch.setenv("MOED_PREFILL_INT8", "1")
    monkeypatch.setattr(routed_ffn, "PREFILL_TOKENS", 256)

    def refuse(*args, **kwargs):
        raise AssertionError("the per-expert GEMM path ran")

    monkeypatch.setattr(cpu_executor_module, "run_expert", refuse)
    monkeypatch.setattr(routed_ffn, "run_expert", refuse)
    bank = _bank(dtype)
    x, ids, w = _routing(300)
    calls = []
    real_moe = type(native()).moe

    def counting_moe(self, desc, xs, *args, **kwargs):
        calls.append(xs.shape[0])
        return real_moe(self, desc, xs, *args, **kwargs)

    monkeypatch.setattr(type(native()), "moe", counting_moe)
    y = CpuExecutor(bank).run(0, x, ids.long(), w)
    assert calls == [256, 44]
    want, tol = routed_reference(bank, x, ids, w)
    assert float(((y.double() - want).abs() / tol).max()) <= 1.0
    whole = real_moe(native(), descriptor_of(bank), x, ids, w)
    assert torch.equal(y, whole)


@needs_native
def test_without_the_policy_many_tokens_take_the_per_expert_path(monkeypatch):
    monkeypatch.setenv("MOED_PREFILL_INT8", "0")
    bank = _bank("int4")
    x, ids, w = _routing(MAX_TOKENS + 1)
    seen = []
    real = cpu_executor_module.run_expert

    def counting(bank_, fid, rows):
        seen.append(fid)
        return real(bank_, fid, rows)

    monkeypatch.setattr(cpu_executor_module, "run_expert", counting)
    y = CpuExecutor(bank).run(0, x, ids.long(), w)
    assert sorted(seen) == sorted(set(ids.view(-1).tolist())) and y.shape == (MAX_TOKENS + 1, D)
    assert not routed_ffn.uses_native(bank, MAX_TOKENS + 1) and routed_ffn.uses_native(bank, MAX_TOKENS)


@needs_native
def test_after_a_prefill_sized_call_the_pool_gives_its_scratch_back_and_small_calls_stay_right():
    """A 400-token call at the bench shape needs ~40 MB of pool scratch; the next one-token call
    takes the shrinking branch of moed_pool_scratch (more than 32 MiB held, 16x less needed) and
    must still compute the twin's values, and so must a big call after it (growing again)."""
    gen = torch.Generator().manual_seed(5)
    d, inter, experts = 2048, 768, 2
    bank = build_expert_bank(torch.randn(experts, d, 2 * inter, generator=gen) / d**0.5,
                             torch.randn(experts, inter, d, generator=gen) / inter**0.5,
                             num_moe_layers=1, num_experts=experts, dtype="int4", activation=ExpertActivation())
    desc, lib = descriptor_of(bank), native()
    big_x = torch.randn(400, d, generator=gen)
    big_ids = torch.tensor([[0, 1]] * 400, dtype=torch.int32)
    big_w = torch.rand(400, 2, generator=gen)
    first = lib.moe(desc, big_x, big_ids, big_w)
    x = torch.randn(1, d, generator=gen)
    ids, w = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([[0.3, 0.7]])
    y = lib.moe(desc, x, ids, w)
    want, tol = routed_reference(bank, x, ids, w)
    assert float(((y.double() - want).abs() / tol).max()) <= 1.0
    assert torch.equal(lib.moe(desc, big_x, big_ids, big_w), first)
