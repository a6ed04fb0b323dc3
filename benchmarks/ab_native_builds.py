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
import sys
from pathlib import Path

import moed  # noqa: F401  (moed before torch: thread settings)
import moed.kernels.native_cpu as native_cpu
from ab_rounds import add_arguments, alternate, print_medians, ratio
from moed.engine.runtime import open_runtime
from moed.kernels.numba_runtime import configure_threads
from moed.models.decode_chain import DecodeChain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    add_arguments(ap, rounds=7)
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

    def use(lib):
        def switch() -> None:
            native_cpu._native = chain.lib = lib
        return switch

    try:
        times, tokens = alternate(rt, {name: use(lib) for name, lib in libs.items()}, args, warm_each=True)
    finally:
        native_cpu._native = chain.lib = libs["new"]
        rt.close()
    print_medians(f"{args.model}; old = {args.old}, new = {args.new}", times, args)
    print(f"  old / new: {ratio(times, 'old', 'new'):.3f} (above 1: new is faster); "
          f"greedy tokens identical: {tokens['old'] == tokens['new']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
