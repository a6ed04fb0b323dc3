"""The Mamba-2 layer (Nemotron-H's state-space mixer) against transformers' own module.

transformers runs its pure-torch path here (no mamba_ssm / causal_conv1d): the chunked scan over a whole
sequence. Ours runs the token-by-token recurrence for short calls (decode) and its own chunked form for
prefills, with per-sequence state: the state carried between calls must give the same output as one call over
the whole sequence; the chunked form is also held against the recurrence directly.
"""

from __future__ import annotations

import pytest
import torch

from moed.layers.mamba2 import Mamba2Config, Mamba2Mixer, chunked_ssd, recurrent_ssd

transformers = pytest.importorskip("transformers")


def _reference(heads: int = 8, groups: int = 2, chunk: int = 16):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    config = transformers.NemotronHConfig(
        vocab_size=64, hidden_size=64, hybrid_override_pattern="M", num_attention_heads=4, num_key_value_heads=2,
        mamba_num_heads=heads, mamba_head_dim=16, n_groups=groups, ssm_state_size=16, conv_kernel=4,
        chunk_size=chunk, layer_norm_epsilon=1e-5)
    torch.manual_seed(3)
    module = NemotronHMamba2Mixer(config, 0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "norm.weight":
                p.uniform_(0.8, 1.2)
            elif name in ("dt_bias", "D"):
                p.normal_(0, 0.5)
            elif name == "A_log":
                p.uniform_(-1.0, 1.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.3)
    weights = {f"m.{name}": p.detach().clone() for name, p in module.named_parameters()}
    cfg = Mamba2Config(num_heads=heads, head_dim=16, num_groups=groups, state_size=16, conv_kernel=4, eps=1e-5)
    return module, Mamba2Mixer(cfg, weights, "m")


def _fresh(layer: Mamba2Mixer, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = layer.state_shapes()
    return torch.zeros(rows, *shapes["conv"]), torch.zeros(rows, *shapes["recurrent"])


@pytest.mark.parametrize("groups", [1, 2, 8], ids=["one-group", "two-groups", "group-per-head"])
def test_one_call_and_calls_that_carry_the_state_match_transformers(groups):
    module, ours = _reference(groups=groups)
    x = torch.randn(1, 23, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = module(x)
    span = float(want.abs().max())
    conv, state = _fresh(ours)
    torch.testing.assert_close(ours.forward(x, [23], conv, state), want, rtol=0, atol=1e-4 * span)
    # a prefill of 9 tokens, one of 10, then 4 decode steps: the state carries the sequence
    conv, state = _fresh(ours)
    parts = [ours.forward(x[:, :9], [9], conv, state), ours.forward(x[:, 9:19], [10], conv, state)]
    parts += [ours.forward(x[:, i:i + 1], [1], conv, state) for i in range(19, 23)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=0, atol=1e-4 * span)


def test_a_long_prefill_in_chunks_matches_transformers():
    """300 tokens: whole chunks and a partial one, then as 150 + 140 token prefills and 10 decode steps."""
    module, ours = _reference(chunk=64)
    x = torch.randn(1, 300, 64, generator=torch.Generator().manual_seed(6)) * 0.5
    with torch.no_grad():
        want = module(x)
    span = float(want.abs().max())
    conv, state = _fresh(ours)
    torch.testing.assert_close(ours.forward(x, [300], conv, state), want, rtol=0, atol=1e-4 * span)
    conv, state = _fresh(ours)
    parts = [ours.forward(x[:, :150], [150], conv, state), ours.forward(x[:, 150:290], [140], conv, state)]
    parts += [ours.forward(x[:, i:i + 1], [1], conv, state) for i in range(290, 300)]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=0, atol=1e-4 * span)


def test_rows_of_a_batch_keep_their_own_state():
    _, ours = _reference()
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(1, 12, 64, generator=gen), torch.randn(1, 5, 64, generator=gen)
    conv, state = _fresh(ours, 2)
    batch = torch.zeros(2, 12, 64)
    batch[0], batch[1, :5] = a[0], b[0]
    got = ours.forward(batch, [12, 5], conv, state)
    alone = [ours.forward(t, [t.shape[1]], *_fresh(ours)) for t in (a, b)]
    torch.testing.assert_close(got[0], alone[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, :5], alone[1][0], rtol=0, atol=1e-5)
    assert float(got[1, 5:].abs().max()) == 0.0


@pytest.mark.parametrize("t,chunk", [(128, 128), (200, 64), (37, 16), (5, 128)])
@pytest.mark.parametrize("strength", [0.1, 4.0], ids=["slow-decay", "fast-decay"])
def test_the_chunked_form_equals_the_recurrence(t, chunk, strength):
    gen = torch.Generator().manual_seed(t + chunk)
    heads, groups, p, n = 8, 2, 16, 16
    x = torch.randn(t, heads, p, generator=gen)
    dt = torch.rand(t, heads, generator=gen) * strength
    a = -torch.rand(heads, generator=gen) * 2
    b, c = torch.randn(t, groups, n, generator=gen), torch.randn(t, groups, n, generator=gen)
    s0 = torch.randn(heads, p, n, generator=gen)
    s_ref, s_chk = s0.clone(), s0.clone()
    want = recurrent_ssd(x, dt, a, b, c, s_ref)
    got = chunked_ssd(x, dt, a, b, c, s_chk, chunk=chunk)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * scale)
    torch.testing.assert_close(s_chk, s_ref, rtol=0, atol=2e-5 * float(s_ref.abs().max()))


def test_configs_that_cannot_be_built_say_why():
    with pytest.raises(ValueError, match="multiple of 3 groups"):
        Mamba2Config(num_heads=8, head_dim=16, num_groups=3, state_size=16, conv_kernel=4)
    with pytest.raises(ValueError, match="time_step_limit"):
        Mamba2Config(num_heads=8, head_dim=16, num_groups=2, state_size=16, conv_kernel=4, dt_min=1.0, dt_max=0.5)
