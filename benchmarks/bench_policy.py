"""Prints decode miss rates of every split policy at several cache sizes as markdown tables.

Synthetic traces (high / low temporal locality, uniform) by default; ``--trace FILE`` replays a
recorded routing trace (JSON lines, see moed/experts/routing_trace.py; token- or layer-major, it
replays in execution order either way) instead. No model, no GPU.

    .venv/bin/python benchmarks/bench_policy.py
    .venv/bin/python benchmarks/bench_policy.py --trace routes.jsonl --num-experts 128 --json
"""

from __future__ import annotations

import argparse
import sys

from moed.errors import MoedError
from moed.experts.policies import POLICY_NAMES
from moed.experts.policy_replay import (DEFAULT_B_H, DEFAULT_B_P, SYNTHETIC_KINDS, run_policy_bench,
                                        synthetic_trace)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="routing trace (JSON lines); default: synthetic traces")
    ap.add_argument("--num-experts", type=int, help="experts per MoE layer (default: inferred from the trace)")
    ap.add_argument("--cache-fractions", type=_floats, default=[0.10, 0.25, 0.50],
                    help="comma-separated fractions of all experts that fit in the cache")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated split policies")
    ap.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    ap.add_argument("--b-p", type=float, default=DEFAULT_B_P, help="PCIe expert-transfer GB/s")
    ap.add_argument("--b-h", type=float, default=DEFAULT_B_H, help="host expert-execution GB/s")
    ap.add_argument("--layers", type=int, default=16, help="synthetic: MoE layers")
    ap.add_argument("--experts", type=int, default=128, help="synthetic: experts per layer")
    ap.add_argument("--top-k", type=int, default=8, help="synthetic: experts per token")
    ap.add_argument("--prefill", type=int, default=128, help="synthetic: prefill positions before decode")
    ap.add_argument("--tokens", type=int, default=300, help="synthetic: decode tokens")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    common = dict(cache_fractions=args.cache_fractions, policies=policies, json=args.json,
                  b_p=args.b_p, b_h=args.b_h)

    if args.trace:
        print(run_policy_bench(args.trace, num_experts=args.num_experts, **common))
        return
    for kind in SYNTHETIC_KINDS:
        trace = synthetic_trace(kind, args.layers, args.experts, args.top_k, args.tokens, args.seed,
                                num_prefill=args.prefill)
        if not args.json:
            print(f"### synthetic {kind!r}: {args.layers} layers x {args.experts} experts, top-{args.top_k}, "
                  f"{args.prefill} prefill + {args.tokens} decode tokens, seed {args.seed}, "
                  f"B_P/B_H = {args.b_p}/{args.b_h}; decode miss rate\n")
        print(run_policy_bench(trace, **common))
        print()


if __name__ == "__main__":
    try:
        main()
    except MoedError as exc:  # a bad trace or option: say what, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
