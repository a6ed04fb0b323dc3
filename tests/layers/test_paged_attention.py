"""Attention over the paged pool in key blocks (layers/paged_attention.py) against the whole-matrix oracle.

The block size is made small here (32 keys) so that every row crosses several key blocks and query
tiles; the pool's blocks are shuffled so that reading through block tables is exercised. Also: gpt-oss
with sinks and a 16-token window against transformers on a 100-token prompt prefilled in two chunks,
and the memory a long-context step allocates.
"""

from __future__ import annotations

import random

import pytest
import torch

from moed.cache.kv_cache import KVCache
from moed.layers import paged_attention as pa
from moed.runner.forward_batch import ForwardBatch

BS = 16


def _pool_with(keys: list[torch.Tensor], values: list[torch.Tensor], starts, lengths, seed: int = 0):
    """A KVCache holding each row's keys/values [L_b, Hk, D] at shuffled blocks, and the step's ForwardBatch."""
    hk, dk, dv = keys[0].shape[1], keys[0].shape[2], values[0].shape[2]
    need = [-(-len(k) // BS) for k in keys]
    order = list(range(sum(need) + 3))
    random.Random(seed).shuffle(order)
    cache = KVCache([{"k": (hk, dk), "v": (hk, dv)}], len(order), BS, torch.float32)
    tables, at = [], 0
    for row, (k, v) in enumerate(zip(keys, values)):
        table = order[at: at + need[row]]
        at += need[row]
        tables.append(table)
        for j in range(len(k)):
            cache.entry(0, "k")[table[j // BS], j % BS] = k[j]
            cache.entry(0, "v")[table[j // BS], j % BS] = v[j]
    steps = max(lengths)
    batch = ForwardBatch(torch.zeros(len(keys), steps, dtype=torch.long), list(starts), list(lengths),
                         list(range(len(keys))), tables)
    return cache, batch


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(pa, "KEY_BLOCK", 32)
    monkeypatch.setattr(pa, "QUERY_TILE", 16)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("shape", [(4, 4, 16, 16), (8, 2, 16, 16), (4, 1, 16, 16), (4, 4, 24, 16)],
                         ids=["mha", "gqa", "one-kv-head", "mla-dims"])
@pytest.mark.parametrize("path", ["cpu-kernel", "reference"])
def test_key_blocks_merge_to_the_whole_matrix_result(small_blocks, monkeypatch, window, sinks, shape, path):
    if path == "reference":
        monkeypatch.setattr(pa, "_block", lambda q, k, v, scale, mask, causal: pa.block_reference(q, k, v, scale,
                                                                                                   mask, causal))
    h, hk, dk, dv = shape
    g = torch.Generator().manual_seed(hash((window, sinks, shape)) % 1000)
    starts, lengths = [0, 37, 100, 7], [50, 1, 13, 70]
    totals = [s + n for s, n in zip(starts, lengths)]
    keys = [torch.randn(t, hk, dk, generator=g) for t in totals]
    values = [torch.randn(t, hk, dv, generator=g) for t in totals]
    cache, batch = _pool_with(keys, values, starts, lengths)
    steps = max(lengths)
    q = torch.randn(len(starts), h, steps, dk, generator=g)
    sink = torch.randn(h, generator=g) if sinks else None

    def read_kv(row, j0, j1):
        return tuple(cache.read_range(0, name, batch, row, j0, j1).transpose(0, 1) for name in ("k", "v"))

    got = pa.attend_paged(q, read_kv, starts, lengths, 0.3, window=window, sinks=sink, value_dim=dv)
    num_keys = max(totals)
    dense_k = torch.zeros(len(starts), hk, num_keys, dk)
    dense_v = torch.zeros(len(starts), hk, num_keys, dv)
    for row, (k, v) in enumerate(zip(keys, values)):
        dense_k[row, :, : len(k)], dense_v[row, :, : len(v)] = k.transpose(0, 1), v.transpose(0, 1)
    want = pa.attend_dense(q, dense_k, dense_v, pa.dense_mask(starts, lengths, steps, num_keys, window), 0.3, sink)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(got[row, :n], want[row, :n], rtol=1e-5, atol=1e-5)
        assert torch.all(got[row, n:] == 0)


def test_gpt_oss_with_sinks_and_a_window_matches_transformers_beyond_the_window(small_blocks, tmp_path):
    """A tiny gpt-oss with a 16-token window (sliding and full layers, sinks), a 100-token prompt prefilled in
    two chunks (40 + 60) through the paged pool: every position's logits as transformers computes them."""
    pytest.importorskip("transformers")
    from helpers.tiny_models import build_tiny_model, tiny_config
    from moed.engine.runtime import open_runtime

    config = tiny_config("gpt_oss")
    config.sliding_window = 16
    config.max_position_embeddings = 256
    reference = build_tiny_model("gpt_oss", tmp_path, config=config)
    prompt = torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0]
    runtime = open_runtime(tmp_path)
    try:
        cache = runtime.model.new_pool(16, BS)
        table = list(range(15, -1, -1))[:7]  # blocks in reverse order
        parts = []
        for start, end in ((0, 40), (40, 100)):
            batch = ForwardBatch.from_token_lists([prompt[start:end]], [start], [0], [table])
            parts.append(runtime.model.forward(batch, cache, last_only=False)[0, : end - start])
        got = torch.cat(parts)
    finally:
        runtime.close()
    assert runtime.model.layers[0][1].window == 16
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


def _rss_and_peak() -> tuple[int, int]:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0]) << 10, int(status["VmHWM"].split()[0]) << 10


@pytest.mark.parametrize("sinks", [True, False])
def test_a_long_context_step_allocates_no_query_by_key_tensor(sinks):
    """A 512-token chunk at position 32,256 with 64 heads: a score tensor [H, T, L] would be 4.3 GB (the old
    sink path built it twice), the mask [T, L] 17 MB; the step's peak RSS rises by far less than either's
    share (the pool itself is allocated before the peak is reset)."""
    from moed.layers.attention import MhaAttention
    from moed.layers.layer_config import AttentionConfig, RopeConfig
    from moed.layers.rotary import RotaryEmbedding

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("no /proc/self/clear_refs (Linux only): the peak RSS cannot be reset")
    h, hk, dh, hidden, steps, start = 64, 8, 64, 256, 512, 32256
    cfg = AttentionConfig(kind="mha", num_heads=h, num_kv_heads=hk, head_dim=dh, has_sinks=sinks, scaling=dh ** -0.5)
    g = torch.Generator().manual_seed(0)
    weights = {f"a.{p}_proj.weight": torch.randn(h * dh if p in "qo" else hk * dh, hidden, generator=g) * 0.05
               for p in "qkv"}
    weights["a.o_proj.weight"] = torch.randn(hidden, h * dh, generator=g) * 0.05
    if sinks:
        weights["a.sinks"] = torch.randn(h, generator=g)
    rotary = RotaryEmbedding(RopeConfig(theta=1_000_000.0, dim=dh), start + steps)
    layer = MhaAttention(cfg, weights, "a", 0, rotary, None, 1e-6)
    total = start + steps
    cache = KVCache([{"k": (hk, dh), "v": (hk, dh)}], total // BS, BS, torch.bfloat16)
    cache.entry(0, "k").normal_()
    cache.entry(0, "v").normal_()
    batch = ForwardBatch.from_token_lists([[5] * steps], [start], [0], [list(range(total // BS))])
    x = torch.randn(1, steps, hidden, generator=g)
    cos_sin = rotary.cos_sin(batch.positions)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, _ = _rss_and_peak()
    out = layer.forward(x, batch, cache, cos_sin)
    _, peak = _rss_and_peak()
    assert out.shape == (1, steps, hidden) and torch.isfinite(out).all()
    assert peak - before < 400 << 20, (peak - before) >> 20
