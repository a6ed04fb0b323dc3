"""DeepSeek-V4 prefill on the CPU: a long prompt in the engine's 512-token chunks (issue #33).

    .venv/bin/python benchmarks/bench_v4_prefill.py [--tokens 8000] [--dir /tmp/v4-bench]

A mid-size random DeepSeek-V4 (4 layers, hidden 512, 8 heads of 128, CSA ratio 4 with index_topk 64, HCA ratio
128, sliding window 128; built once with transformers into ``--dir``) prefills ``--tokens`` tokens chunk by chunk
through the model's paged attention, as the engine does on the CPU; the script prints the time, tokens/s and
the process's peak RSS. There is no peer (llama.cpp has no DeepSeek-V4 in the llama-cpp-python build moed
compares with): the figures compare moed's commits, run on one machine (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.tiny_models import build_tiny_model  # noqa: E402
from moed.engine.runtime import open_runtime  # noqa: E402
from moed.runner.forward_batch import ForwardBatch  # noqa: E402

CHUNK = 512


def build(path: Path) -> None:
    import transformers as tf

    cfg = tf.DeepseekV4Config(
        vocab_size=1024, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, head_dim=128, q_lora_rank=256,
        moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=128,
        index_n_heads=8, index_head_dim=64, index_topk=64, sliding_window=128, max_position_embeddings=65536,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    build_tiny_model("deepseek_v4", path, config=cfg, scale=1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--dir", default="/tmp/v4-bench")
    args = ap.parse_args()
    path = Path(args.dir)
    if not (path / "config.json").exists():
        build(path)
    runtime = open_runtime(path)
    ids = torch.randint(3, 1000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = runtime.model.new_cache(1, args.tokens + 8)
    start = time.perf_counter()
    for s in range(0, args.tokens, CHUNK):
        runtime.model.forward(ForwardBatch.from_token_lists([ids[s:s + CHUNK]], [s], [0]), cache)
    took = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"prefill {args.tokens} tokens in {CHUNK}-token chunks: {took:.2f} s, {args.tokens / took:.0f} tok/s, "
          f"peak RSS {rss:.0f} MB")
    runtime.close()


if __name__ == "__main__":
    main()
