"""The gated DeltaNet layer (Qwen3-Next's linear attention) against transformers' own module.

transformers runs its pure-torch fallbacks here (the chunked delta rule for a whole sequence, no
conv kernels installed); ours runs the token-by-token rule for short calls (decode) and its own
chunk-parallel form for prefills, with per-sequence state. The state carried between calls must give
the same output as one call over the whole sequence; the chunked rule is also held against the
token-by-token one directly (lengths that are and are not whole chunks, strong and weak decay).
"""

from __future__ import annotations

import pytest
import torch

from moed.layers.gated_deltanet import DeltaNetConfig, GatedDeltaNet, chunked_delta_rule, recurrent_delta_rule

transformers = pytest.importorskip("transformers")


def _reference(num_k_heads: int, num_v_heads: int):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        linear_num_key_heads=num_k_heads, linear_num_value_heads=num_v_heads, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(3)
    module = Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "norm.weight":
                p.uniform_(0.8, 1.2)
            elif name == "dt_bias":
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.3)
    weights = {f"la.{name}": p.detach().clone() for name, p in module.named_parameters()}
    cfg = DeltaNetConfig(num_k_heads, num_v_heads, 16, 24, 4, eps=1e-6)
    return module, GatedDeltaNet(cfg, weights, "la")


def _fresh_state(layer: GatedDeltaNet, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = layer.state_shapes()
    return torch.zeros(rows, *shapes["conv"]), torch.zeros(rows, *shapes["recurrent"])


@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["hv=hk", "grouped-values"])
def test_one_call_and_chunked_calls_match_transformers(heads):
    module, ours = _reference(*heads)
    x = torch.randn(1, 23, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = module(x)  # [1, 23, 64]
    conv, state = _fresh_state(ours)
    got = ours.forward(x, [23], conv, state)
    span = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * span)
    # the same sequence as a prefill of 9 tokens, one of 10, then 4 decode steps: the state carries it
    conv, state = _fresh_state(ours)
    parts = [ours.forward(x[:, :9], [9], conv, state), ours.forward(x[:, 9:19], [10], conv, state)]
    parts += [ours.forward(x[:, i:i + 1], [1], conv, state) for i in range(19, 23)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=0, atol=1e-4 * span)


@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["hv=hk", "grouped-values"])
def test_a_long_prefill_through_the_chunked_rule_matches_transformers(heads):
    """300 tokens: the chunked rule (whole chunks and a partial one), then as 150 + 140 token prefills
    (a chunked call resuming from a chunked call's state) and 10 decode steps."""
    module, ours = _reference(*heads)
    x = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(6)) * 0.5
    with torch.no_grad():
        want = module(x)
    span = float(want.abs().max())
    conv, state = _fresh_state(ours)
    torch.testing.assert_close(ours.forward(x, [300], conv, state), want, rtol=0, atol=1e-4 * span)
    conv, state = _fresh_state(ours)
    parts = [ours.forward(x[:, :150], [150], conv, state), ours.forward(x[:, 150:290], [140], conv, state)]
    parts += [ours.forward(x[:, i:i + 1], [1], conv, state) for i in range(290, 300)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=0, atol=1e-4 * span)


@pytest.mark.parametrize("length", [1, 17, 128, 129, 300])
@pytest.mark.parametrize("decay", [0.05, 3.0, 12.0], ids=["weak-decay", "strong-decay", "forgetful"])
@pytest.mark.parametrize("chunk", [4, 128])
def test_the_chunked_rule_is_the_token_by_token_rule(length, decay, chunk):
    g = torch.Generator().manual_seed(length)
    h, dk, dv = 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(length, h, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(length, h, dk, generator=g), dim=-1)
    v = torch.randn(length, h, dv, generator=g)
    beta = torch.rand(length, h, generator=g)
    log_decay = -torch.rand(length, h, generator=g) * decay
    start = torch.randn(h, dk, dv, generator=g)
    s_ref, s_chunked = start.clone(), start.clone()
    want = recurrent_delta_rule(q, k, v, beta, log_decay, s_ref)
    got = chunked_delta_rule(q, k, v, beta, log_decay, s_chunked, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * float(want.abs().max()))
    torch.testing.assert_close(s_chunked, s_ref, rtol=0, atol=2e-5 * float(s_ref.abs().max()))


def test_rows_of_a_batch_keep_their_own_state_and_padding_changes_nothing():
    _, ours = _reference(2, 4)
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randn(1, 12, 64, generator=gen), torch.randn(1, 7, 64, generator=gen)
    alone = []
    for seq in (a, b):
        conv, state = _fresh_state(ours)
        alone.append((ours.forward(seq, [seq.shape[1]], conv, state), conv.clone(), state.clone()))
    batch = torch.zeros(2, 12, 64)
    batch[0], batch[1, :7] = a[0], b[0]
    batch[1, 7:] = 100.0  # padding: must not reach the output or the state
    conv, state = _fresh_state(ours, 2)
    out = ours.forward(batch, [12, 7], conv, state)
    torch.testing.assert_close(out[0], alone[0][0][0])
    torch.testing.assert_close(out[1, :7], alone[1][0][0])
    assert torch.equal(out[1, 7:], torch.zeros(5, 64))
    torch.testing.assert_close(state[1], alone[1][2][0])
    torch.testing.assert_close(conv[1], alone[1][1][0])


def test_bad_head_counts_are_refused():
    with pytest.raises(ValueError, match="not a multiple"):
        DeltaNetConfig(num_k_heads=3, num_v_heads=4, k_head_dim=8, v_head_dim=8, conv_kernel=4)


def test_heads_that_wipe_their_memory_now_and_then_keep_the_chunked_rule_exact():
    """Per-head decays near 0 with a few tokens of -300 (a head clearing its state): the chunk's cumulative decay is
    summed in float64, or float32's rounding of G at -1000s shows in the small differences (4e-5 of the output)."""
    gen = torch.Generator().manual_seed(0)
    t, h, d = 256, 4, 64
    q = torch.nn.functional.normalize(torch.randn(t, h, d, generator=gen), dim=-1) * d ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, d, generator=gen), dim=-1)
    v, beta = torch.randn(t, h, d, generator=gen), torch.rand(t, h, generator=gen)
    log_decay = -0.01 * torch.rand(t, h, generator=gen)
    log_decay[torch.rand(t, h, generator=gen) < 0.05] = -300.0
    s0 = 0.1 * torch.randn(h, d, d, generator=gen)
    s_ref, s_chk = s0.clone(), s0.clone()
    want = recurrent_delta_rule(q, k, v, beta, log_decay, s_ref)
    got = chunked_delta_rule(q, k, v, beta, log_decay, s_chk)
    assert float((got - want).norm() / want.norm()) < 2e-6
    assert float((s_chk - s_ref).norm() / s_ref.norm()) < 2e-6
