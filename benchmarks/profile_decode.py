"""Where the milliseconds of one moed decode step go: attention, router, experts, lm_head, the rest.

    .venv/bin/python benchmarks/profile_decode.py MODEL [--tokens 64] [--threads 2] [--busy]

MODEL is anything `moed generate --model` takes (a GGUF file, an HF or FTW directory). The script
runs a 16-token prompt and `--tokens` greedy decode steps and prints the mean milliseconds per
decode step of each part. With the native decode chain (models/decode_chain.py: every layer in
one native call) the parts are the chain's own clock (projections, attention, router, experts,
norms and adds, summed over layers); on the Python path the script wraps the parts with timers
(perf_counter around attention.forward, the router, the expert executor). The lm_head is timed
around its projection either way; "other" is the rest of the step (embedding, final norm,
sampling, the engine loop: Python and small torch ops). ``--busy`` profiles with one core kept
busy by ``python3 -c "while True: pass"``.
A second table splits the step at the native library's boundary (every ctypes call into
native/cpu timed, by entry point): time inside the kernels, and the Python / torch glue outside
them, per step and per layer.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time

import moed.layers.moe as moe_module
import moed.models.moe_transformer as model_module
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.kernels.native_cpu import CHAIN_PARTS, native, native_status
from moed.models.decode_chain import DecodeChain
from moed.kernels.numba_runtime import configure_threads

totals: collections.Counter = collections.Counter()
native_time: collections.Counter = collections.Counter()
native_calls: collections.Counter = collections.Counter()


class TimedLibrary:
    """Stands in for the ctypes library of moed.kernels.native_cpu: times every moed_* entry point."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if not name.startswith("moed_") or name in ("moed_cpu_isa", "moed_cpu_threads"):
            return fn

        def call(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                native_time[name] += time.perf_counter() - t0
                native_calls[name] += 1
        return call


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--experts-dtype", help="the bank dtype to load (default: the file's own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a spinning Python process")
    args = ap.parse_args()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        return profile(args)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def profile(args) -> int:
    configure_threads(args.threads)
    rt = open_runtime(args.model, experts_dtype=args.experts_dtype)
    model = rt.model
    chain = model.decode_chain()
    chain_timings = chain.enable_timings() if isinstance(chain, DecodeChain) else None
    if chain_timings is None:  # the Python decode path: time its parts from outside
        for _, attention, _, mlp in model.layers:
            attention.forward = timed("attention (projections + cache + softmax)", attention.forward)
            if isinstance(mlp, moe_module.MoeLayer):
                mlp.executor = type("Timed", (), {"run": staticmethod(timed("routed experts", mlp.executor.run))})()
        moe_module.route = timed("router", moe_module.route)
    model_module.linear = timed("lm_head", model_module.linear)
    lib = native()
    if lib is not None:
        lib._lib = TimedLibrary(lib._lib)  # a benchmark's probe: the handle the wrappers call through
    prompt = [(7 * i + 11) % (model.config.vocab_size - 100) + 50 for i in range(16)]
    run_offline(rt, [prompt], [SamplingParams(max_tokens=4, ignore_eos=True)], context_length=64)  # warm-up
    totals.clear()
    native_time.clear()
    native_calls.clear()
    if chain_timings is not None:
        chain_timings.zero_()
    t0 = time.perf_counter()
    (done,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)],
                          context_length=args.tokens + 32)
    wall = time.perf_counter() - t0
    prefill = done.usage.ttft_s
    decode_s = wall - prefill
    # the prefill step is in the totals too: take it out proportionally is not possible, so run it alone
    if chain_timings is not None:  # the chain's own clock, per part (it runs decode steps only)
        for name, sec in zip(CHAIN_PARTS, chain_timings.tolist()):
            totals[f"decode chain: {name}"] += sec
    totals_all = dict(totals)
    native_all, calls_all = dict(native_time), dict(native_calls)
    totals.clear()
    native_time.clear()
    native_calls.clear()
    run_offline(rt, [prompt], [SamplingParams(max_tokens=1, ignore_eos=True)], context_length=args.tokens + 32)
    prefill_parts = dict(totals)
    prefill_native, prefill_calls = dict(native_time), dict(native_calls)
    steps = args.tokens
    print(f"{args.model}: {steps} decode steps, {decode_s / steps * 1e3:.2f} ms/step "
          f"({steps / decode_s:.1f} tok/s); backend {native_status()}; decode path: "
          + ("the native decode chain" if chain_timings is not None else f"Python ({chain.reason})"))
    print("| part | ms/step | share |\n|---|---:|---:|")
    parts = {k: (v - prefill_parts.get(k, 0.0)) / steps for k, v in totals_all.items()}
    step_ms = decode_s / steps
    for name, sec in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {sec * 1e3:.2f} | {sec / step_ms:.0%} |")
    other = step_ms - sum(parts.values())
    print(f"| other (norms, embedding, adds, sampling, engine loop) | {other * 1e3:.2f} | {other / step_ms:.0%} |")
    if native_all:
        layers = len(model.layers)
        inside = {k: (v - prefill_native.get(k, 0.0)) / steps for k, v in native_all.items()}
        calls = {k: (v - prefill_calls.get(k, 0)) / steps for k, v in calls_all.items()}
        outside = step_ms - sum(inside.values())
        print("\n| native entry point | ms/step | calls/step |\n|---|---:|---:|")
        for name, sec in sorted(inside.items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {sec * 1e3:.2f} | {calls[name]:.0f} |")
        print(f"| outside the native calls (Python and torch glue; / {layers} layers = "
              f"{outside / layers * 1e3:.2f}) | {outside * 1e3:.2f} | |")
    print(json.dumps({"ms_per_step": step_ms * 1e3, **{k: v * 1e3 for k, v in parts.items()}}), file=sys.stderr)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
