"""In-process A/B of the native decode chain against the layer-by-layer Python decode path.

    .venv/bin/python benchmarks/ab_decode_chain.py MODEL [--rounds 6] [--tokens 48] [--busy]

One process, one loaded model; each round decodes ``--tokens`` greedy tokens after a 16-token
prompt once with the chain (models/decode_chain.py) and once without it, alternating, and the
script prints the median ms/step of each and their ratio (benchmarks/ab_rounds.py: on this VM one
fresh-process run moves by 15-20%, so only alternation inside one process compares the two
fairly). ``--busy`` keeps one core busy with ``python3 -c "while True: pass"`` for the whole
measurement. The greedy tokens of both paths must be identical (the chain gives the Python path's
bits); the script says so.
"""

from __future__ import annotations

import argparse
import sys

import moed  # noqa: F401  (moed before torch: thread settings)
from ab_rounds import add_arguments, alternate, print_medians, ratio
from moed.engine.runtime import open_runtime
from moed.kernels.numba_runtime import configure_threads
from moed.models.decode_chain import DecodeChain, Unsupported


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    add_arguments(ap, rounds=6)
    args = ap.parse_args()
    configure_threads(args.threads)
    rt = open_runtime(args.model)
    chain = rt.model.decode_chain()
    if not isinstance(chain, DecodeChain):
        print(f"{args.model}: no decode chain ({chain.reason}); nothing to compare", file=sys.stderr)
        return 1

    def use(on: bool):
        def switch() -> None:
            rt.model._chain = chain if on else Unsupported("A/B: the Python path")
        return switch

    try:
        times, tokens = alternate(rt, {"chain": use(True), "python": use(False)}, args)
    finally:
        rt.model._chain = chain
        rt.close()
    print_medians(args.model, times, args)
    print(f"  python / chain: {ratio(times, 'python', 'chain'):.3f}; "
          f"greedy tokens identical: {tokens['chain'] == tokens['python']}")
    return 0 if tokens["chain"] == tokens["python"] else 2


if __name__ == "__main__":
    sys.exit(main())
