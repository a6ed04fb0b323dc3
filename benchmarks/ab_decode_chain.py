"""In-process A/B of the native decode chain against the layer-by-layer Python decode path.

    .venv/bin/python benchmarks/ab_decode_chain.py MODEL [--rounds 6] [--tokens 48] [--busy]

One process, one loaded model; each round decodes ``--tokens`` greedy tokens after a 16-token
prompt once with the chain (models/decode_chain.py) and once without it, alternating, and the
script prints the median ms/step of each and their ratio (on this VM one fresh-process run moves
by 15-20%, so only alternation inside one process compares the two fairly). ``--busy`` keeps one
core busy with ``python3 -c "while True: pass"`` for the whole measurement. The greedy tokens of
both paths must be identical (the chain gives the Python path's bits); the script says so.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

import moed  # noqa: F401  (moed before torch: thread settings)
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.kernels.numba_runtime import configure_threads
from moed.models.decode_chain import DecodeChain, Unsupported


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a spinning Python process")
    args = ap.parse_args()
    configure_threads(args.threads)
    rt = open_runtime(args.model)
    chain = rt.model.decode_chain()
    if not isinstance(chain, DecodeChain):
        print(f"{args.model}: no decode chain ({chain.reason}); nothing to compare", file=sys.stderr)
        return 1
    prompt = [(7 * i + 11) % (rt.model.config.vocab_size - 100) + 50 for i in range(16)]
    run_offline(rt, [prompt], [SamplingParams(max_tokens=4, ignore_eos=True)], context_length=args.tokens + 32)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    times: dict[str, list[float]] = {"chain": [], "python": []}
    tokens: dict[str, list[int]] = {}
    try:
        for _ in range(args.rounds):
            for name in times:
                rt.model._chain = chain if name == "chain" else Unsupported("A/B: the Python path")
                (done,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)],
                                      context_length=args.tokens + 32)
                times[name].append(1e3 / done.usage.decode_tok_s)
                tokens[name] = done.token_ids
    finally:
        rt.model._chain = chain
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        rt.close()
    print(f"{args.model}: {args.rounds} alternating rounds of {args.tokens} tokens"
          + (", one core busy" if args.busy else ""))
    for name, values in times.items():
        print(f"  {name:6s} median {statistics.median(values):6.2f} ms/step  ("
              + " ".join(f"{v:.2f}" for v in values) + ")")
    ratio = statistics.median(times["python"]) / statistics.median(times["chain"])
    print(f"  python / chain: {ratio:.3f}; greedy tokens identical: {tokens['chain'] == tokens['python']}")
    return 0 if tokens["chain"] == tokens["python"] else 2


if __name__ == "__main__":
    sys.exit(main())
