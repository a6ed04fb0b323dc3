#!/usr/bin/env python3
"""A whole DeepSeek-V3-shaped decode step against the context length (issue #30: "8k within 1.3x of 1k").

    .venv/bin/python benchmarks/bench_deepseek_decode.py [--contexts 1024,8192] [--experts 32]
        [--experts-dtype int4] [--steps 5] [--json OUT]

Two layers at DeepSeek-V3's widths, built with transformers (random bf16 weights): layer 0 dense (MLP
18432), layer 1 MoE (``--experts`` routed experts of 2048, top-8, one shared expert); MLA with 128
heads, q LoRA 1536, kv LoRA 512, nope 128, rope 64, v 128; vocab 32,000. Fewer experts than the real
256 keep the build small; a decode token reads 8 routed experts either way, so the step's expert cost
is the real one. moed loads it on the CPU (``--experts-dtype`` bank), the latent cache is filled with
random values up to each context, and one decode token is timed there (best of ``--steps``): absorbed
MLA over the latent, the MoE layer, the dense layer, the head. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

BS = 16


def build(dst: Path, experts: int) -> None:
    import transformers as tf

    config = tf.DeepseekV3Config(vocab_size=32000, hidden_size=7168, intermediate_size=18432,
                                 moe_intermediate_size=2048, num_hidden_layers=2, num_attention_heads=128,
                                 num_key_value_heads=128, n_shared_experts=1, n_routed_experts=experts,
                                 num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128, max_position_embeddings=16384)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()
    model.save_pretrained(dst, safe_serialization=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--experts-dtype", default="int4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()

    from moed.config import EngineConfig
    from moed.engine.runtime import open_runtime
    from moed.runner.forward_batch import ForwardBatch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.experts)
        runtime = open_runtime(Path(tmp), experts_dtype=args.experts_dtype, engine=EngineConfig(device="cpu"))
        model = runtime.model
        for context in (int(c) for c in args.contexts.split(",")):
            blocks = -(-(context + 1) // BS)
            cache = model.new_pool(blocks, BS)
            for entries in cache.layers:
                for t in entries.values():
                    t.normal_()
            batch = lambda: ForwardBatch.from_token_lists([[7]], [context], [0], [list(range(blocks))])  # noqa: E731
            model.forward(batch(), cache)  # warm (the absorbed kv_b copy is made once)
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                model.forward(batch(), cache)
                times.append(time.perf_counter() - start)
            rows.append({"context": context, "step_ms": min(times) * 1e3})
            print(f"context {context:>6}: {min(times) * 1e3:8.1f} ms per decode step", flush=True)
            del cache
        runtime.close()
    base = rows[0]["step_ms"]
    for r in rows[1:]:
        print(f"{r['context']} / {rows[0]['context']}: {r['step_ms'] / base:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
