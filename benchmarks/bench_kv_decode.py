"""Decode ms/step at long contexts: what the KV cache's layout and dtype cost the CPU decode path.

    .venv/bin/python benchmarks/bench_kv_decode.py MODEL [--contexts 256,2048,4096] [--steps 24]
        [--kv-dtype model|fp32|bf16] [--json]

One process, one loaded model, CPU device. For each context length a random prompt of that many
tokens is prefilled, then ``--steps`` greedy decode steps are timed (median ms/step). The KV pool is
the model's own (bf16 for a bf16 model), or the one ``--kv-dtype`` names. Run it in two checkouts
(e.g. before and after a KV change) alternately to compare them: see docs/benchmarks.md (#14).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import moed  # noqa: F401  (moed before torch: thread settings)
import torch

from moed.engine.runtime import open_runtime
from moed.runner.forward_batch import ForwardBatch


def decode_ms(model, context: int, steps: int) -> float:
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    cache = model.new_cache(1, context + steps + 1)
    logits = None
    for start in range(0, context, 512):  # prefill in the engine's CPU chunks
        logits = model.forward(ForwardBatch.from_token_lists([prompt[start:start + 512]], [start], [0]), cache)
    token = int(logits.argmax(-1)[0])
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        logits = model.forward(ForwardBatch.from_token_lists([[token]], [context + i], [0]), cache)
        times.append(time.perf_counter() - t0)
        token = int(logits.argmax(-1)[0])
    return 1e3 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--contexts", default="256,2048,4096")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kv-dtype", choices=("model", "fp32", "bf16"), default="model")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rt = open_runtime(args.model)
    model = rt.model
    if args.kv_dtype != "model" and hasattr(model, "kv_dtype"):  # (a checkout before paged KV: always fp32)
        model.kv_dtype = torch.float32 if args.kv_dtype == "fp32" else torch.bfloat16
    out = {"kv_dtype": str(getattr(model, "kv_dtype", torch.float32)).replace("torch.", "")}
    for context in (int(c) for c in args.contexts.split(",")):
        out[context] = round(decode_ms(model, context, args.steps), 2)
    rt.close()
    print(json.dumps(out) if args.json else "  ".join(f"{k}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
