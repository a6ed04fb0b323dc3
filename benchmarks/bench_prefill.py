"""Prefill time of one prompt on a loaded model, several rounds in one process (CPU prefill kernels, A/B of two trees).

    .venv/bin/python benchmarks/bench_prefill.py MODEL [--words 900] [--rounds 2] [--json OUT]

The prompt is ``--words`` words drawn with a fixed seed from a short word list (901 tokens for 900 words with the
SmolLM2 tokenizer of the real-size GGUFs of build_real_size_gguf.py); each round runs it through the engine loop
(`run_offline`, a fresh loop and KV pool, so no prefix is reused) with one generated token, and prints the
seconds from submission to the end. The first round includes first-touch costs (page faults of the mapped
weights, scratch growth); compare later rounds.

To compare the kernels of two commits on the same file, check the older one out as a worktree, build its
library there, and point ``moed`` at it (the editable install maps ``moed`` to this tree's ``daemon/``; a
``moed`` directory on PYTHONPATH comes first):

    git worktree add /tmp/old OLD_COMMIT && (cd /tmp/old && ../path/to/.venv/bin/python setup.py -q build_ext --inplace)
    mkdir -p /tmp/oldpkg && ln -sfn /tmp/old/daemon /tmp/oldpkg/moed
    PYTHONPATH=/tmp/oldpkg .venv/bin/python benchmarks/bench_prefill.py MODEL     # the old tree
    .venv/bin/python benchmarks/bench_prefill.py MODEL                            # this one

alternating the two a few times (a fresh process on these VMs moves by 15-25%). Not part of CI.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import moed  # noqa: F401  (moed before torch: thread settings)
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams

WORDS = "the quick brown fox jumps over lazy dog and then runs into forest where many trees grow tall".split()


def prompt_text(words: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--words", type=int, default=900)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the rounds' seconds here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rt = open_runtime(args.model)
    load_s = time.perf_counter() - t0
    try:
        ids = rt.tokenizer.encode(prompt_text(args.words))
        print(f"{args.model}: loaded in {load_s:.1f} s, prompt {len(ids)} tokens, moed from {moed.__file__}", flush=True)
        seconds = []
        for r in range(args.rounds):
            t = time.perf_counter()
            (done,) = run_offline(rt, [ids], [SamplingParams(max_tokens=1, temperature=0.0)])
            seconds.append(time.perf_counter() - t)
            if done.finish_reason == "error":
                print(f"error: {done.error}", file=sys.stderr)
                return 1
            print(f"round {r + 1}: prefill {seconds[-1]:.1f} s ({len(ids) / seconds[-1]:.1f} tok/s), "
                  f"first token {done.token_ids}", flush=True)
    finally:
        rt.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "prompt_tokens": len(ids), "load_s": load_s, "prefill_s": seconds}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
