"""The native router (native/cpu/router.c) against moed.layers.moe.route's torch code."""

from __future__ import annotations

import pytest
import torch

import moed.layers.moe as moe_module
from moed.kernels.native_cpu import native
from moed.layers.layer_config import MoeConfig

LIB = native()
pytestmark = pytest.mark.skipif(LIB is None, reason="native CPU kernels not built")


# (experts, top-k, D, scoring, renormalise, bias): Qwen3-MoE, Mixtral, OLMoE-like, gpt-oss
CASES = [(128, 8, 2048, "softmax", True, False), (8, 2, 96, "softmax", True, False),
         (64, 8, 70, "softmax", False, False), (32, 4, 48, "topk_softmax", False, True)]


def _routed_through(monkeypatch, entry: str, cfg, x, weight, bias):
    """``moe.route``'s result, checking that it went through the native ``entry`` exactly once."""
    calls = []
    real = getattr(LIB, entry)
    with monkeypatch.context() as m:
        m.setattr(LIB, entry, lambda *a, **k: calls.append(1) or real(*a, **k))
        result = moe_module.route(cfg, x, weight, bias, None)
    assert calls == [1], f"decode routing did not take the native {entry}"
    return result


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}-E{c[0]}-k{c[1]}-D{c[2]}")
def test_native_route_matches_torch(case, isa, monkeypatch):
    experts, top_k, d, scoring, renorm, has_bias = case
    gen = torch.Generator().manual_seed(experts + d)
    cfg = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=16, scoring=scoring, norm_topk_prob=renorm)
    weight = torch.randn(experts, d, generator=gen) * 0.1  # logits of a few units, as real routers give
    bias = torch.randn(experts, generator=gen) if has_bias else None
    for tokens in (1, 3, 16):
        x = torch.randn(tokens, d, generator=gen)
        ids, weights = _routed_through(monkeypatch, "route", cfg, x, weight, bias)
        with monkeypatch.context() as m:
            m.setattr(moe_module, "native", lambda: None)
            want_ids, want_weights = moe_module.route(cfg, x, weight, bias, None)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32
        assert torch.equal(ids, want_ids), (ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=2e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_bad_arguments_are_refused():
    weight = torch.zeros(6, 32)
    weight[4] = 1.0
    ids, weights = LIB.route(torch.ones(1, 32), weight, None, "softmax", 3, True)
    assert ids.tolist() == [[4, 0, 1]]
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="float32"):
        LIB.route(torch.ones(1, 32), weight.bfloat16(), None, "softmax", 3, True)
    with pytest.raises(ValueError, match="scoring"):
        LIB.route(torch.ones(1, 32), weight, None, "sigmoid", 3, True)
    with pytest.raises(ValueError, match="refused"):
        LIB.route(torch.ones(1, 32), weight, None, "softmax", 7, True)  # more than E experts


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}-E{c[0]}-k{c[1]}-D{c[2]}")
def test_a_bf16_router_takes_the_native_choice_on_its_gemv_logits(case, monkeypatch):
    """bf16 routers (HF bf16 checkpoints): logits from the dense bf16 GEMV, then moed_route_select."""
    experts, top_k, d, scoring, renorm, has_bias = case
    gen = torch.Generator().manual_seed(3 * experts + d)
    cfg = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=16, scoring=scoring, norm_topk_prob=renorm)
    weight = (torch.randn(experts, d, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(experts, generator=gen).bfloat16() if has_bias else None
    for tokens in (1, 5):
        x = torch.randn(tokens, d, generator=gen)
        ids, weights = _routed_through(monkeypatch, "route_select", cfg, x, weight, bias)
        logits = x @ weight.float().T + (bias.float() if bias is not None else 0.0)
        with monkeypatch.context() as m:  # the torch choice on float32 logits of the same weights
            m.setattr(moe_module, "native", lambda: None)
            want_ids, want_weights = moe_module.route(cfg, x, weight.float(), None if bias is None else bias.float(),
                                                      None)
        assert torch.equal(ids, want_ids), (ids, want_ids, logits)
        torch.testing.assert_close(weights, want_weights, rtol=2e-4, atol=1e-5)


def test_route_select_refuses_bad_arguments():
    with pytest.raises(ValueError, match="scoring"):
        LIB.route_select(torch.zeros(1, 4), "sigmoid", 2, True)
    with pytest.raises(ValueError, match="refused"):
        LIB.route_select(torch.zeros(1, 4), "softmax", 5, True)
    with pytest.raises(ValueError, match="float32"):
        LIB.route_select(torch.zeros(1, 4, dtype=torch.float64), "softmax", 2, True)
