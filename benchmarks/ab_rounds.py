"""The alternating-rounds harness of the in-process A/B scripts (ab_decode_chain.py, ab_native_builds.py).

On these VMs a fresh process moves by 15-25%, so two variants are compared inside one process with
one loaded model: each round decodes ``--tokens`` greedy tokens after a 16-token prompt once per
variant, alternating, and the medians of ms/step are compared. A variant is a name and a function
that switches the model to it before its run. ``--busy`` keeps one core busy with
``python3 -c "while True: pass"`` for the whole measurement.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from typing import Callable

from moed.engine.offline_run import run_offline
from moed.engine.sampling import SamplingParams


def add_arguments(ap: argparse.ArgumentParser, rounds: int) -> None:
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a spinning Python process")


def alternate(rt, variants: dict[str, Callable[[], None]], args: argparse.Namespace, *, warm_each: bool = False
              ) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """ms/step of every round and the last greedy tokens, per variant (the last variant stays set)."""
    prompt = [(7 * i + 11) % (rt.model.config.vocab_size - 100) + 50 for i in range(16)]
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    for switch in variants.values() if warm_each else list(variants.values())[:1]:
        switch()
        run_offline(rt, [prompt], [warm], context_length=args.tokens + 32)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    times: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {}
    try:
        for _ in range(args.rounds):
            for name, switch in variants.items():
                switch()
                (done,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)],
                                      context_length=args.tokens + 32)
                times[name].append(1e3 / done.usage.decode_tok_s)
                tokens[name] = done.token_ids
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return times, tokens


def print_medians(title: str, times: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(f"{title}: {args.rounds} alternating rounds of {args.tokens} tokens" + (", one core busy" if args.busy else ""))
    width = max(len(name) for name in times)
    for name, values in times.items():
        print(f"  {name:{width}s} median {statistics.median(values):6.2f} ms/step  ("
              + " ".join(f"{v:.2f}" for v in values) + ")")


def ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """median ms/step of ``slow`` over that of ``fast`` (above 1: ``fast`` is faster)."""
    return statistics.median(times[slow]) / statistics.median(times[fast])
