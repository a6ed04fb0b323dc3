"""The native decode attention (native/cpu/attn_decode.c) against the torch path of MhaAttention."""

from __future__ import annotations

import pytest
import torch

import moed.layers.attention as attention_module
from moed.cache.kv_cache import KVCache
from moed.kernels.native_cpu import native
from moed.layers.attention import MhaAttention
from moed.layers.layer_config import AttentionConfig, RopeConfig
from moed.layers.rotary import RotaryEmbedding
from moed.runner.forward_batch import ForwardBatch

LIB = native()
pytestmark = pytest.mark.skipif(LIB is None, reason="native CPU kernels not built")


# (heads, kv heads, head dim, qk norm, rotated dims, interleaved, window, sinks, bias)
CASES = {
    "qwen3": (8, 2, 64, "per_head", 64, False, None, False, False),
    "gpt-oss": (4, 4, 48, "none", 48, False, 5, True, True),
    "partial-interleaved": (6, 3, 40, "none", 16, True, None, False, False),
    "mqa-odd-dim": (5, 1, 33, "per_head", 32, False, 3, True, False),
    "olmoe-full-norm": (4, 2, 32, "full", 32, False, None, False, False),
}


def _layer(case: str, gen: torch.Generator) -> tuple[MhaAttention, AttentionConfig, RotaryEmbedding, int | None]:
    heads, kv_heads, dh, qk_norm, rot, inter, window, sinks, bias = CASES[case]
    hidden = 24
    cfg = AttentionConfig(kind="mha", num_heads=heads, num_kv_heads=kv_heads, head_dim=dh, has_qkv_bias=bias,
                          qk_norm=qk_norm, has_sinks=sinks, scaling=dh ** -0.5)
    w = {}
    for name, rows in (("q", heads * dh), ("k", kv_heads * dh), ("v", kv_heads * dh)):
        w[f"a.{name}_proj.weight"] = torch.randn(rows, hidden, generator=gen) * 0.5
        if bias:
            w[f"a.{name}_proj.bias"] = torch.randn(rows, generator=gen)
    w["a.o_proj.weight"] = torch.randn(hidden, heads * dh, generator=gen) * 0.2
    if qk_norm != "none":
        n_q, n_k = (dh, dh) if qk_norm == "per_head" else (heads * dh, kv_heads * dh)
        w["a.q_norm.weight"] = 1 + 0.3 * torch.randn(n_q, generator=gen)
        w["a.k_norm.weight"] = 1 + 0.3 * torch.randn(n_k, generator=gen)
    if sinks:
        w["a.sinks"] = torch.randn(heads, generator=gen)
    rotary = RotaryEmbedding(RopeConfig(theta=1000.0, dim=rot, interleaved=inter), 64)
    return MhaAttention(cfg, w, "a", 0, rotary, window, 1e-6), cfg, rotary, window


def _run(layer: MhaAttention, rotary: RotaryEmbedding, cache: KVCache, x: torch.Tensor, batch: ForwardBatch):
    return layer.forward(x, batch, cache, rotary.cos_sin(batch.positions))


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_decode_attention_matches_torch(case, isa, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    layer, cfg, rotary, _ = _layer(case, gen)
    caches = [KVCache([layer.cache_entries()], num_slots=3, max_len=20) for _ in range(2)]
    history = {name: torch.randn(3, 20, *shape, generator=gen) for name, shape in layer.cache_entries().items()}
    for cache in caches:
        for name, t in history.items():
            cache.entry(0, name).copy_(t)
    # rows at different depths and slots; row 2 is padding (length 0)
    batch = ForwardBatch(torch.zeros(4, 1, dtype=torch.int64), starts=[0, 11, 5, 16], lengths=[1, 1, 0, 1],
                         slots=[2, 0, 1, 1])
    batch_ref = ForwardBatch(batch.input_ids, batch.starts, batch.lengths, batch.slots)
    x = torch.randn(4, 1, 24, generator=gen)
    got = _run(layer, rotary, caches[0], x, batch)
    with monkeypatch.context() as m:
        m.setattr(attention_module, "native", lambda: None)
        want = _run(layer, rotary, caches[1], x, batch_ref)
    valid = [0, 1, 3]
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-5)
    for name in ("k", "v"):
        torch.testing.assert_close(caches[0].entry(0, name), caches[1].entry(0, name), rtol=1e-5, atol=1e-6)
    # the padding row wrote nothing: slot 1 at index 5 still holds its history
    assert torch.equal(caches[0].entry(0, "k")[1, 5], history["k"][1, 5])


def test_the_native_path_is_the_one_taken(monkeypatch):
    """A decode step must not fall back to torch silently (the kernel would then be dead code)."""
    gen = torch.Generator().manual_seed(3)
    layer, _, rotary, _ = _layer("qwen3", gen)
    cache = KVCache([layer.cache_entries()], num_slots=1, max_len=8)
    calls = []
    real = LIB.attn_decode
    monkeypatch.setattr(LIB, "attn_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(attention_module, "attend", lambda *a, **k: pytest.fail("torch attention ran at decode"))
    batch = ForwardBatch(torch.zeros(1, 1, dtype=torch.int64), starts=[3], lengths=[1], slots=[0])
    _run(layer, rotary, cache, torch.randn(1, 1, 24, generator=gen), batch)
    assert calls == [1]


def test_bad_arguments_are_refused():
    q, k, v = torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    common = dict(num_heads=1, num_kv_heads=1, q_norm=None, k_norm=None, eps=1e-6, rot_dim=8, interleaved=False,
                  cos=torch.ones(1, 4), sin=torch.zeros(1, 4), k_cache=cache, v_cache=cache.clone(), starts=[0],
                  positions=[0], lengths=[1], num_keys=1, window=None, scale=1.0, sinks=None)
    out = LIB.attn_decode(q, k, v, slots=[1], **common)
    assert out.shape == (1, 8)
    with pytest.raises(ValueError, match="shapes"):
        LIB.attn_decode(q, k, v, slots=[2], **common)  # no such slot
    with pytest.raises(ValueError, match="refused"):
        LIB.attn_decode(q, k, v, slots=[0], **{**common, "starts": [4]})  # past the cache
    with pytest.raises(ValueError, match="float32"):
        LIB.attn_decode(q.double(), k, v, slots=[0], **common)
