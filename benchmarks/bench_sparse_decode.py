#!/usr/bin/env python3
"""DeepSeek Sparse Attention decode (and prefill) against the context length: the chosen keys vs every key.

    python benchmarks/bench_sparse_decode.py [--contexts 4096,16384,65536] [--prefill 512] [--json OUT]

One DeepSeek-V3.2 attention layer (hidden 7168, 128 heads, q LoRA 1536, kv LoRA 512, nope 128, rope 64, v 128;
lightning indexer of 64 heads x 128 keeping 2048 keys; random bf16 weights; bf16 pool with the latent, the
rotary key and the indexer's key filled to each context) runs one decode token: "sparse" is what moed runs
for DeepSeek-V3.2 / GLM-5 (the indexer scores every key, the absorbed attention reads the 2048 it keeps);
"dense" is the same layer without its indexer (DeepSeek-V3's absorbed decode over every key). Reported:
ms per step (best of 5), and the indexer's own share (its keys' scoring and the top-k). ``--prefill N`` also
times a chunk of N new tokens at each depth (best of 3): there every query of the chunk scores every key
before it and attends through a per-block mask, so sparse prefill costs more than dense (the indexer's
N x L scores); what it saves is every later decode step. No peer: llama.cpp has no sparse-attention path for
these models.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moed.cache.kv_cache import KVCache
from moed.layers import mla_attention
from moed.layers.layer_config import AttentionConfig, RopeConfig
from moed.layers.rotary import RotaryEmbedding
from moed.runner.forward_batch import ForwardBatch

BS = 16
HIDDEN = 7168


def layer(sparse: bool) -> tuple[mla_attention.MlaAttention, RotaryEmbedding]:
    cfg = AttentionConfig(kind="mla", num_heads=128, num_kv_heads=128, head_dim=192, q_lora_rank=1536,
                          kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                          scaling=192 ** -0.5, index_topk=2048 if sparse else 0, index_num_heads=64,
                          index_head_dim=128)
    g = torch.Generator().manual_seed(0)
    w = lambda *shape: (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()  # noqa: E731
    weights = {"a.q_a_proj.weight": w(1536, HIDDEN), "a.q_a_layernorm.weight": torch.ones(1536),
               "a.q_b_proj.weight": w(128 * 192, 1536), "a.kv_a_proj_with_mqa.weight": w(512 + 64, HIDDEN),
               "a.kv_a_layernorm.weight": torch.ones(512), "a.kv_b_proj.weight": w(128 * 256, 512),
               "a.o_proj.weight": w(HIDDEN, 128 * 128),
               "a.indexer.wq_b.weight": w(64 * 128, 1536), "a.indexer.wk.weight": w(128, HIDDEN),
               "a.indexer.k_norm.weight": torch.ones(128), "a.indexer.k_norm.bias": torch.zeros(128),
               "a.indexer.weights_proj.weight": w(64, HIDDEN)}
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, dim=64, interleaved=True), 1 << 20)
    attn = mla_attention.MlaAttention(cfg, weights, "a", 0, rotary, None, 1e-6, index_source=0 if sparse else None)
    return attn, rotary


def best_of(fn, n: int = 5) -> float:
    fn()  # warm (the absorbed weights are split once)
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--prefill", type=int, default=0, help="also time a chunk of this many new tokens")
    ap.add_argument("--json")
    args = ap.parse_args()
    sparse, rotary = layer(True)
    dense, _ = layer(False)
    x = torch.randn(1, 1, HIDDEN)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        blocks = -(-(context + 1) // BS)
        cache = KVCache([sparse.cache_entries()], blocks, BS, torch.bfloat16)
        for name in ("latent", "k_rot", "index_k"):
            cache.entry(0, name).normal_()
        batch = ForwardBatch.from_token_lists([[1]], [context], [0], [list(range(blocks))])
        cos_sin = rotary.cos_sin(batch.positions)
        q_resid = torch.randn(1, 1, 1536)
        row = {"context": context,
               "sparse_ms": best_of(lambda: sparse.forward(x, batch, cache, cos_sin)),
               "indexer_ms": best_of(lambda: sparse._choose(x, q_resid, batch, cache, cos_sin)),
               "dense_ms": best_of(lambda: dense.forward(x, batch, cache, cos_sin))}
        row["dense_over_sparse"] = round(row["dense_ms"] / row["sparse_ms"], 2)
        if args.prefill:
            n = args.prefill
            start = context - n
            chunk = ForwardBatch.from_token_lists([[1] * n], [start], [0], [list(range(blocks))])
            xs, cs = torch.randn(1, n, HIDDEN), rotary.cos_sin(chunk.positions)
            row["prefill_tokens"] = n
            row["prefill_sparse_ms"] = best_of(lambda: sparse.forward(xs, chunk, cache, cs), 3)
            row["prefill_dense_ms"] = best_of(lambda: dense.forward(xs, chunk, cache, cs), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
