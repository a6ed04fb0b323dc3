"""The native decode attention (native/cpu/attn_decode.c) against the torch path of MhaAttention."""

from __future__ import annotations

import pytest
import torch

import moed.layers.attention as attention_module
from moed.cache import q8_0
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


# block size 4: row 1 (11 tokens cached) and row 3 (16) share their first two blocks (a common
# prefix) and write into blocks of their own; row 2 is padding (length 0, nothing written)
TABLES = [[3], [7, 2, 9], [5, 6], [7, 2, 0, 14, 10]]


def _fill(caches: list[KVCache], layer: MhaAttention, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The same random history in every cache (q8_0: quantised, scales included); the pool values returned."""
    history = {}
    for name, shape in layer.cache_entries().items():
        values = torch.randn(caches[0].num_blocks, caches[0].block_size, *shape, generator=gen)
        if caches[0].quantized:
            q, d = q8_0.quantize(values)
            history[name] = q
            for cache in caches:
                cache.entry_scale(0, name).copy_(d)
        else:
            history[name] = values.to(caches[0].dtype)
        for cache in caches:
            cache.entry(0, name).copy_(history[name])
    return history


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "q8_0"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_native_decode_attention_matches_torch(case, dtype, isa, monkeypatch):
    if dtype == torch.int8 and CASES[case][2] % 32:
        pytest.skip("q8_0 K/V needs head dims of a multiple of 32")
    gen = torch.Generator().manual_seed(7)
    layer, cfg, rotary, _ = _layer(case, gen)
    caches = [KVCache([layer.cache_entries()], num_blocks=16, block_size=4, dtype=dtype) for _ in range(2)]
    history = _fill(caches, layer, gen)
    batch = ForwardBatch(torch.zeros(4, 1, dtype=torch.int64), starts=[0, 11, 5, 16], lengths=[1, 1, 0, 1],
                         slots=[0, 1, 2, 3], block_tables=TABLES)
    batch_ref = ForwardBatch(batch.input_ids, batch.starts, batch.lengths, batch.slots, TABLES)
    x = torch.randn(4, 1, 24, generator=gen)
    got = _run(layer, rotary, caches[0], x, batch)
    with monkeypatch.context() as m:
        m.setattr(attention_module, "native", lambda: None)
        want = _run(layer, rotary, caches[1], x, batch_ref)
    valid = [0, 1, 3]
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-5)
    # the new keys and values landed in the same pool rows (bf16: both round to nearest even; q8_0: both
    # quantise as llama.cpp; the float32 values before rounding may differ in their last bit)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for name in ("k", "v"):
        stored = [c.entry(0, name).float() if dtype != torch.int8
                  else q8_0.dequantize(c.entry(0, name), c.entry_scale(0, name)) for c in caches]
        torch.testing.assert_close(stored[0], stored[1], **tol)
        changed = (caches[0].entry(0, name) != history[name]).flatten(2).any(-1).nonzero().tolist()
        assert changed == [[3, 0], [9, 3], [10, 0]], f"{name}: rows written {changed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_static_slots_and_block_tables_address_the_same_rows(dtype):
    """A batch naming slots of a ``for_slots`` cache reads and writes exactly what the same batch with
    those slots' block tables does."""
    gen = torch.Generator().manual_seed(5)
    layer, _, rotary, _ = _layer("qwen3", gen)
    caches = [KVCache.for_slots([layer.cache_entries()], 3, 20, dtype, block_size=8) for _ in range(2)]
    for name, shape in layer.cache_entries().items():
        history = torch.randn(caches[0].num_blocks, 8, *shape, generator=gen).to(dtype)
        for cache in caches:
            cache.entry(0, name).copy_(history)
    x = torch.randn(2, 1, 24, generator=gen)
    slots = ForwardBatch(torch.zeros(2, 1, dtype=torch.int64), starts=[13, 4], lengths=[1, 1], slots=[2, 0])
    tables = ForwardBatch(slots.input_ids, slots.starts, slots.lengths, [0, 1], [[6, 7, 8], [0, 1, 2]])
    torch.testing.assert_close(_run(layer, rotary, caches[0], x, slots), _run(layer, rotary, caches[1], x, tables))
    for name in ("k", "v"):
        assert torch.equal(caches[0].entry(0, name), caches[1].entry(0, name))


def test_the_native_path_is_the_one_taken(monkeypatch):
    """A decode step must not fall back to torch silently (the kernel would then be dead code)."""
    gen = torch.Generator().manual_seed(3)
    layer, _, rotary, _ = _layer("qwen3", gen)
    cache = KVCache.for_slots([layer.cache_entries()], 1, 8)
    calls = []
    real = LIB.attn_decode
    monkeypatch.setattr(LIB, "attn_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(attention_module, "attend_paged", lambda *a, **k: pytest.fail("torch attention ran at decode"))
    batch = ForwardBatch(torch.zeros(1, 1, dtype=torch.int64), starts=[3], lengths=[1], slots=[0])
    _run(layer, rotary, cache, torch.randn(1, 1, 24, generator=gen), batch)
    assert calls == [1]


def test_bad_arguments_are_refused():
    q, k, v = torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(1, 8)
    pool = torch.zeros(2, 4, 1, 8)  # 2 blocks of 4 tokens
    common = dict(num_heads=1, num_kv_heads=1, q_norm=None, k_norm=None, eps=1e-6, rot_dim=8, interleaved=False,
                  cos=torch.ones(1, 4), sin=torch.zeros(1, 4), k_cache=pool, v_cache=pool.clone(), starts=[0],
                  positions=[0], lengths=[1], num_keys=1, window=None, scale=1.0, sinks=None)
    table = lambda *blocks: torch.tensor([blocks], dtype=torch.int32)  # noqa: E731
    out = LIB.attn_decode(q, k, v, block_tables=table(1), **common)
    assert out.shape == (1, 8)
    with pytest.raises(ValueError, match="refused"):
        LIB.attn_decode(q, k, v, block_tables=table(2), **common)  # no such block
    with pytest.raises(ValueError, match="refused"):
        LIB.attn_decode(q, k, v, block_tables=table(0), **{**common, "starts": [4]})  # past the row's table
    with pytest.raises(ValueError, match="refused"):
        LIB.attn_decode(q, k, v, block_tables=table(0, -1), **{**common, "starts": [5]})  # a negative block
    with pytest.raises(ValueError, match="int32"):
        LIB.attn_decode(q, k, v, block_tables=table(0).long(), **common)
    with pytest.raises(ValueError, match="float32"):
        LIB.attn_decode(q.double(), k, v, block_tables=table(0), **common)
    with pytest.raises(ValueError, match="pools"):
        LIB.attn_decode(q, k, v, block_tables=table(0), **{**common, "k_cache": pool.half(), "v_cache": pool.half()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "q8_0"])
def test_a_long_context_matches_torch(dtype, isa, monkeypatch):
    """Hundreds of keys: the vectorised softmax (max, exp, sum in VW lanes) and the key tiles of the value sums
    run whole, with ragged tails (333 and 1000 keys)."""
    gen = torch.Generator().manual_seed(11)
    layer, _, rotary, _ = _layer("qwen3", gen)
    caches = [KVCache([layer.cache_entries()], num_blocks=128, block_size=16, dtype=dtype) for _ in range(2)]
    _fill(caches, layer, gen)
    tables = [list(range(0, 64))[::-1], list(range(64, 128))]
    batch = ForwardBatch(torch.zeros(2, 1, dtype=torch.int64), starts=[333, 1000], lengths=[1, 1], slots=[0, 1],
                         block_tables=tables)
    x = torch.randn(2, 1, 24, generator=gen) * 3
    got = _run(layer, rotary, caches[0], x, batch)
    with monkeypatch.context() as m:
        m.setattr(attention_module, "native", lambda: None)
        want = _run(layer, rotary, caches[1], x, ForwardBatch(batch.input_ids, batch.starts, batch.lengths,
                                                               batch.slots, tables))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
