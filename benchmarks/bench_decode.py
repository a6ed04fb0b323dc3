"""Decode speed of the split policies on the emulated device, side by side in one run.

    python benchmarks/bench_decode.py --model models/demo-moe-ftw [--tokens 64] [--cache-fraction 0.25]
        [--bp 16] [--policies adaptive,fill-all,cpu-all]

Wall tok/s is what this CPU-only machine achieves (the emulated device's compute really runs on
these cores, after the CPU branch). "modelled MoE ms/token" is the engine's timing model: per
MoE layer max(CPU branch measured, copies measured + device compute charged at the emulated
device bandwidth), summed: the expert time a GPU with this link would see.
"""

from __future__ import annotations

import argparse
import sys
import time

from moed.config import EngineConfig
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams

PROMPT = "Write a short story about a robot who learns to paint."


def run(model: str, policy: str, tokens: int, fraction: float, b_p: float) -> dict:
    runtime = open_runtime(model, engine=EngineConfig(device="emulated", cache_fraction=fraction, policy=policy,
                                                      emulated_b_p=b_p))
    try:
        prompt = runtime.encode_prompt(PROMPT, chat=True)
        started = time.perf_counter()
        (result,) = run_offline(runtime, [prompt], [SamplingParams(max_tokens=tokens, ignore_eos=True)],
                                context_length=1024)
        wall = time.perf_counter() - started
        s = runtime.executor.stats
        return dict(policy=policy, text=result.text, tok_s=result.usage.decode_tok_s, ttft=result.usage.ttft_s, wall=wall,
                    hits=s.hits, misses=s.misses, fills=s.fills + s.transient_fills, cpu=s.cpu_experts, miss_rate=s.miss_rate,
                    modelled_ms=s.modelled_seconds / len(result.token_ids) * 1e3,
                    b_p=s.b_p, b_h=s.b_h, slots=s.cache_slots)
    finally:
        runtime.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/demo-moe-ftw")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cache-fraction", type=float, default=0.25)
    parser.add_argument("--bp", type=float, default=16.0, help="emulated B_P, GB/s")
    parser.add_argument("--policies", default="adaptive,fill-all,cpu-all")
    args = parser.parse_args(argv)
    rows = [run(args.model, p, args.tokens, args.cache_fraction, args.bp * 1e9) for p in args.policies.split(",")]
    texts = {r["text"] for r in rows}
    print(f"same text from every policy: {len(texts) == 1}")
    print(f"\n{args.tokens} tokens, cache {args.cache_fraction:.0%} of the pool ({rows[0]['slots']} slots), "
          f"emulated B_P {args.bp} GB/s\n")
    print("| policy | wall decode tok/s | modelled MoE ms/token | miss rate | fills | cpu | hits | B_P GB/s | B_H GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['tok_s']:.1f} | {r['modelled_ms']:.1f} | {r['miss_rate']:.0%} | {r['fills']} | "
              f"{r['cpu']} | {r['hits']} | {r['b_p'] / 1e9:.1f} | {r['b_h'] / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
