"""Modelled decode time per token by policy, with the emulated link set to each of the paper's six machines.

    python benchmarks/bench_profiles.py --model DIR [--tokens 32] [--cache-fraction 0.25]
        [--policies adaptive,fill-all,cpu-all]

For each machine of docs/design.md ("Reference"; the same list as bench_qstar.py) the emulated
device's B_P is set so that B_P / B_H here equals that machine's ratio, with B_H this machine's
own CPU-branch rate on the model's experts (measured by a cpu-all run first). Then each policy
decodes the same greedy tokens and the engine's timing model gives the expert time per token:
per MoE layer max(CPU branch measured, copies measured + device compute charged at the emulated
device's rate), summed. Use a model with large experts (the bench model: Qwen3-30B-A3B-shaped
layers, e.g. ``gpu_check.py``'s ``bench-2``), not the demo's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import run  # noqa: E402
from bench_qstar import MACHINES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache-fraction", type=float, default=0.25)
    ap.add_argument("--policies", default="adaptive,fill-all")
    args = ap.parse_args(argv)
    base = run(args.model, "cpu-all", args.tokens, args.cache_fraction, 16e9)
    b_h = base["b_h"]
    print(f"cache {args.cache_fraction:.0%} of the pool ({base['slots']} slots), {args.tokens} tokens; "
          f"B_H here {b_h / 1e9:.1f} GB/s (cpu-all: {base['modelled_ms']:.1f} modelled ms/token)\n")
    policies = [p for p in args.policies.split(",") if p]
    print("| machine | its B_P / B_H | emulated B_P GB/s | " + " | ".join(f"{p} ms/token" for p in policies)
          + " | cpu-all ms/token | best |")
    print("|---|---:|---:|" + "---:|" * (len(policies) + 2))
    texts = {base["text"]}
    for name, bp, bh in MACHINES:
        ratio = bp / bh
        rows = {p: run(args.model, p, args.tokens, args.cache_fraction, ratio * b_h) for p in policies}
        texts |= {r["text"] for r in rows.values()}
        times = {p: r["modelled_ms"] for p, r in rows.items()} | {"cpu-all": base["modelled_ms"]}
        best = min(times, key=times.get)
        print(f"| {name} | {ratio:.2f} | {ratio * b_h / 1e9:.1f} | "
              + " | ".join(f"{times[p]:.1f}" for p in policies) + f" | {times['cpu-all']:.1f} | {best} |")
    print(f"\nsame text from every run: {len(texts) == 1}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
