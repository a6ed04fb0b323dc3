#!/usr/bin/env python3
"""MLA decode against the context length: attention on the latent cache (absorbed) vs expanding it.

    python benchmarks/bench_mla_decode.py [--contexts 1024,8192] [--json OUT]

One DeepSeek-V3 attention layer (hidden 7168, 128 heads, q LoRA 1536, kv LoRA 512, nope 128, rope 64,
v 128; random bf16 weights; bf16 latent cache) runs one decode token at each context length, absorbed
(what moed runs for decode) and expanded (the prefill form: the whole latent through kv_b each step).
Reported: ms per step (best of 5) and the 8k/1k ratio of each form. The layer's projections are the
same in both; a whole model adds its MoE layers, which do not grow with the context.
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


def layer(hidden: int = 7168) -> tuple[mla_attention.MlaAttention, AttentionConfig, RotaryEmbedding]:
    cfg = AttentionConfig(kind="mla", num_heads=128, num_kv_heads=128, head_dim=192, q_lora_rank=1536,
                          kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                          scaling=192 ** -0.5)
    g = torch.Generator().manual_seed(0)
    w = lambda *shape: (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).bfloat16()  # noqa: E731
    weights = {"a.q_a_proj.weight": w(1536, hidden), "a.q_a_layernorm.weight": torch.ones(1536),
               "a.q_b_proj.weight": w(128 * 192, 1536), "a.kv_a_proj_with_mqa.weight": w(512 + 64, hidden),
               "a.kv_a_layernorm.weight": torch.ones(512), "a.kv_b_proj.weight": w(128 * 256, 512),
               "a.o_proj.weight": w(hidden, 128 * 128)}
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, dim=64, interleaved=True), 1 << 16)
    return mla_attention.MlaAttention(cfg, weights, "a", 0, rotary, None, 1e-6), cfg, rotary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--json")
    args = ap.parse_args()
    attn, cfg, rotary = layer()
    x = torch.randn(1, 1, 7168)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        blocks = -(-(context + 1) // BS)
        cache = KVCache([attn.cache_entries()], blocks, BS, torch.bfloat16)
        cache.entry(0, "latent").normal_()
        cache.entry(0, "k_rot").normal_()
        batch = ForwardBatch.from_token_lists([[1]], [context], [0], [list(range(blocks))])
        cos_sin = rotary.cos_sin(batch.positions)
        row = {"context": context}
        for form, limit in (("absorbed", 8), ("expanded", 0)):
            mla_attention.ABSORB_MAX_STEPS = limit
            attn.forward(x, batch, cache, cos_sin)  # warm (the absorbed weights are split once)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                attn.forward(x, batch, cache, cos_sin)
                best = min(best, time.perf_counter() - start)
            row[f"{form}_ms"] = round(best * 1e3, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    first, last = rows[0], rows[-1]
    summary = {f"{form}_ratio": round(last[f"{form}_ms"] / first[f"{form}_ms"], 2) for form in ("absorbed", "expanded")}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows, **summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
