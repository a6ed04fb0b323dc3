#!/usr/bin/env python3
"""A step that mixes decode rows with a prefill chunk: packed (ragged) vs padded to the chunk.

    python benchmarks/bench_ragged_step.py [--decode-rows 4] [--chunk 512] [--depth 4096] [--json OUT]

A 2-layer model at Qwen3-30B-A3B's attention and width (hidden 2048, 32 query / 4 KV heads of 128,
128 experts of 768, top-8; random bf16 weights built with transformers, so the MoE runs moed's
CPU kernels at that shape) runs one engine step: ``--decode-rows`` sequences decoding one token at
``--depth`` keys each plus one ``--chunk``-token prefill chunk at the same depth. Timed per layout
(best of 3): ``padded`` (every row padded to the chunk: what the engine ran before) and ``packed``
(the tokens back to back, what EngineLoop runs now), plus the chunk alone and the decode rows alone,
so the decode rows' marginal cost inside the mixed step is printed. The KV pool holds random keys
and values (attention time depends on sizes only). llama.cpp packs its ubatches the same way; the
comparison here is moed's two layouts on one step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

BS = 16


def build(dst: Path) -> None:
    import transformers as tf

    config = tf.Qwen3MoeConfig(vocab_size=4096, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960,
                               torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.save_pretrained(dst, safe_serialization=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode-rows", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--json")
    args = ap.parse_args()

    from moed.config import EngineConfig
    from moed.engine.runtime import open_runtime
    from moed.runner.forward_batch import ForwardBatch

    rows, chunk, depth = args.decode_rows, args.chunk, args.depth
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        runtime = open_runtime(Path(tmp), engine=EngineConfig(device="cpu"))
        model = runtime.model
        per_seq = -(-(depth + chunk) // BS)
        cache = model.new_pool(per_seq * (rows + 1), BS)
        for entries in cache.layers:
            for t in entries.values():
                t.normal_()
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(rows + 1)]
        g = torch.Generator().manual_seed(1)
        tok = lambda n: torch.randint(3, 4096, (n,), generator=g).tolist()  # noqa: E731
        decode = [(tok(1), depth, i) for i in range(rows)]
        prefill = [(tok(chunk), depth, rows)]

        def step(seqs, packed):
            batch = ForwardBatch.from_token_lists([t for t, _, _ in seqs], [s for _, s, _ in seqs],
                                                  [i for _, _, i in seqs], [tables[i] for _, _, i in seqs],
                                                  packed=packed)
            return lambda: model.forward(batch, cache)

        def best(fn, reps=3):
            fn()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return min(times)

        result = {
            "decode_rows": rows, "chunk": chunk, "depth": depth,
            "chunk_alone_s": best(step(prefill, True)),
            "decode_alone_s": best(step(decode, True)),
            "padded_s": best(step(decode + prefill, False)),
            "packed_s": best(step(decode + prefill, True)),
        }
        runtime.close()
    result["padded_over_packed"] = result["padded_s"] / result["packed_s"]
    result["decode_marginal_padded_s"] = result["padded_s"] - result["chunk_alone_s"]
    result["decode_marginal_packed_s"] = result["packed_s"] - result["chunk_alone_s"]
    print(f"{rows} decode rows + a {chunk}-token chunk at depth {depth}, 2 layers of Qwen3-30B-A3B's shape:")
    print(f"  chunk alone   {result['chunk_alone_s'] * 1e3:8.1f} ms")
    print(f"  decode alone  {result['decode_alone_s'] * 1e3:8.1f} ms")
    print(f"  mixed padded  {result['padded_s'] * 1e3:8.1f} ms  (decode rows add "
          f"{result['decode_marginal_padded_s'] * 1e3:.1f} ms)")
    print(f"  mixed packed  {result['packed_s'] * 1e3:8.1f} ms  (decode rows add "
          f"{result['decode_marginal_packed_s'] * 1e3:.1f} ms)")
    print(f"  padded / packed: {result['padded_over_packed']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
