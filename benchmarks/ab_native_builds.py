"""In-process A/B of two builds of the native CPU kernels on a model's decode step.

    .venv/bin/python benchmarks/ab_native_builds.py MODEL OLD.so NEW.so [--rounds 7] [--tokens 48] [--busy]

Build the two variants first, e.g. the installed one and one with a kernel switch turned off:

    cp daemon/_cpu_kernels*.so /tmp/ab/new.so
    gcc -O3 -std=c11 -pthread -fPIC -shared -DROWS_PF2=0 -Inative/cpu native/cpu/*.c -o /tmp/ab/old.so -lm

One process, one loaded model (its weights are shared by both libraries: the decode chain's
structs point at the model's tensors, not into a library); each round decodes ``--tokens`` greedy
tokens after a 16-token prompt once with each library, alternating, and the script prints the
median ms/step of each and their ratio. On these VMs a fresh process moves by 15-25%, so only
alternation inside one process compares two builds fairly. ``--busy`` keeps one core busy with
``python3 -c "while True: pass"`` for the whole measurement. The greedy tokens of both builds are
compared and reported (kernels that change the order of float sums may change them; a kernel that
is meant to give the same bits must give the same tokens).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import moed  # noqa: F401  (moed before torch: thread settings)
import moed.kernels.native_cpu as native_cpu
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.kernels.numba_runtime import configure_threads
from moed.models.decode_chain import DecodeChain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a spinning Python process")
    args = ap.parse_args()
    configure_threads(args.threads)
    libs = {name: native_cpu.NativeCpu(path, num_threads=args.threads) for name, path in
            (("old", args.old), ("new", args.new))}
    native_cpu._native, native_cpu._loaded = libs["new"], True  # the model binds to one of them
    rt = open_runtime(args.model)
    chain = rt.model.decode_chain()
    if not isinstance(chain, DecodeChain):
        print(f"{args.model}: no decode chain ({chain.reason}); this compares the chain's kernels", file=sys.stderr)
        return 1
    prompt = [(7 * i + 11) % (rt.model.config.vocab_size - 100) + 50 for i in range(16)]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    times: dict[str, list[float]] = {name: [] for name in libs}
    tokens: dict[str, list[int]] = {}
    try:
        for name, lib in libs.items():  # warm both (page faults, pools)
            native_cpu._native, chain.lib = lib, lib
            run_offline(rt, [prompt], [SamplingParams(max_tokens=4, ignore_eos=True)], context_length=args.tokens + 32)
        for _ in range(args.rounds):
            for name, lib in libs.items():
                native_cpu._native, chain.lib = lib, lib
                (done,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)],
                                      context_length=args.tokens + 32)
                times[name].append(1e3 / done.usage.decode_tok_s)
                tokens[name] = done.token_ids
    finally:
        native_cpu._native, chain.lib = libs["new"], libs["new"]
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        rt.close()
    print(f"{args.model}: {args.rounds} alternating rounds of {args.tokens} tokens"
          + (", one core busy" if args.busy else "") + f"; old = {args.old}, new = {args.new}")
    for name, values in times.items():
        print(f"  {name:3s} median {statistics.median(values):6.2f} ms/step  (" + " ".join(f"{v:.2f}" for v in values) + ")")
    ratio = statistics.median(times["old"]) / statistics.median(times["new"])
    print(f"  old / new: {ratio:.3f} (above 1: new is faster); greedy tokens identical: {tokens['old'] == tokens['new']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
