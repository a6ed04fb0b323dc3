"""Kimi Delta Attention (Kimi-Linear's linear attention) against transformers' own module, and its chunked rule
against the token-by-token one.

transformers' whole-sequence torch path (its chunked KDA) sums the cumulative decay in float32 and is ~1e-5 off
a float64 recurrence when decays are strong; its token-by-token path (a decode step through its cache) is the
reference here, as ours is the recurrence: the same weights, one token at a time.
"""

from __future__ import annotations

import pytest
import torch

from moed.layers.kda import KdaConfig, chunked_kda, recurrent_kda

transformers = pytest.importorskip("transformers")


def _reference():
    """transformers' KimiLinearDeltaAttention with strong random weights (decays from ~0 to below -100 per token)
    and the same weights under the checkpoint's names as moed's layer."""
    from helpers.tiny_models import tiny_config
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    cfg = tiny_config("kimi_linear")
    torch.manual_seed(0)
    hf = KimiLinearDeltaAttention(cfg, 0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, (3.0 if "f_" in name else 1.0) / p.shape[1] ** 0.5)
        hf.conv1d.weight.normal_(0, 0.5)
        hf.o_norm.weight.uniform_(0.5, 1.5)
        # built alone (no PreTrainedModel init), these two are uninitialised memory: set as Kimi-Linear's init does
        hf.forget_gate.A_log.copy_(torch.empty_like(hf.forget_gate.A_log).uniform_(1, 16).log())
        hf.forget_gate.dt_bias.normal_(0, 0.5)
    weights = {}
    for name, t in hf.state_dict().items():
        if name == "conv1d.weight":  # transformers' one conv of q | k | v: the checkpoint's three
            for part, piece in zip("qkv", t.detach().clone().chunk(3)):
                weights[f"L.{part}_conv1d.weight"] = piece
        else:
            weights["L." + name.removeprefix("forget_gate.")] = t.detach().clone()
    kda = KdaConfig(num_heads=cfg.linear_num_heads, head_dim=cfg.linear_head_dim,
                    conv_kernel=cfg.linear_conv_kernel_dim, eps=cfg.rms_norm_eps)
    assert {k: tuple(v.shape) for k, v in weights.items()} == kda.weight_shapes("L", cfg.hidden_size)
    return hf, cfg, kda.layer(weights, "L")


def test_prefills_carrying_the_state_and_decode_steps_match_transformers_token_by_token():
    from transformers.cache_utils import DynamicCache

    hf, cfg, ours = _reference()
    x = torch.randn(1, 90, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        want = torch.cat([hf(x[:, t:t + 1], cache=cache)[0] for t in range(90)])
    shapes = ours.state_shapes()
    conv, state = torch.zeros(1, *shapes["conv"]), torch.zeros(1, *shapes["recurrent"])
    parts = [ours.forward(x[:, :40], [40], conv, state), ours.forward(x[:, 40:80], [40], conv, state)]
    parts += [ours.forward(x[:, t:t + 1], [1], conv, state) for t in range(80, 90)]
    got = torch.cat(parts, dim=1)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))
    # the states equal transformers' cache (its conv state keeps K inputs, moed's the last K-1)
    layer = cache.layers[0]
    torch.testing.assert_close(conv[0], layer.conv_states[0][0, :, 1:], rtol=0, atol=1e-6)
    torch.testing.assert_close(state[0], layer.recurrent_states[0][0], rtol=0, atol=1e-4 * float(state.abs().max()))


@pytest.mark.parametrize("t", [5, 64, 200])
@pytest.mark.parametrize("strength", [0.02, 1.0, 50.0], ids=["slow", "medium", "fast"])
def test_the_chunked_rule_equals_the_recurrence(t, strength):
    gen = torch.Generator().manual_seed(t)
    h, dk, dv = 4, 32, 32
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v, beta = torch.randn(t, h, dv, generator=gen), torch.rand(t, h, generator=gen)
    log_decay = -torch.rand(t, h, dk, generator=gen) * strength
    s0 = torch.randn(h, dk, dv, generator=gen)
    s_ref, s_chk = s0.clone(), s0.clone()
    want = recurrent_kda(q, k, v, beta, log_decay, s_ref)
    got = chunked_kda(q, k, v, beta, log_decay, s_chk)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(s_chk, s_ref, rtol=0, atol=1e-5 * float(s_ref.abs().max()))
    assert bool(torch.isfinite(got).all())


def test_one_decay_per_head_is_the_gated_delta_rule():
    from moed.layers.gated_deltanet import recurrent_delta_rule

    gen = torch.Generator().manual_seed(1)
    t, h, dk = 70, 2, 16
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v, beta, g = torch.randn(t, h, dk, generator=gen), torch.rand(t, h, generator=gen), -torch.rand(t, h, generator=gen)
    state = torch.zeros(h, dk, dk)
    want = recurrent_delta_rule(q, k, v, beta, g, state.clone())
    got = chunked_kda(q, k, v, beta, g[..., None].expand(t, h, dk), state.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
