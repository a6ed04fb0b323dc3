#!/usr/bin/env python3
"""Where moed's memory goes during a long prompt: RSS and glibc's heap sampled while it runs (issue #30).

    ONEDNN_PRIMITIVE_CACHE_CAPACITY=N LRU_CACHE_CAPACITY=N \
    .venv/bin/python benchmarks/bench_step_memory.py MODEL [--prompt 8192] [--decode-tokens 4]

MODEL is anything ``open_runtime`` loads (build_real_size_gguf.py's files are the intended ones). The
process caps glibc's arenas as `moed serve` does, runs a 16-token warm-up, then one prompt of
``--prompt`` tokens through the engine loop (run_offline: 512-token chunks) and ``--decode-tokens``
tokens at that depth, while a thread samples RSS (/proc/self/statm) and mallinfo2 every 20 ms. It
prints the weights and K/V moed holds, TTFT, and at the peak: RSS, malloc'd bytes in use, free bytes
the arenas keep, and mmapped chunks; then the malloc'd bytes in use after each prefill step (a steady
climb is memory kept per step). Not part of CI (Linux/glibc only).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time

from moed.engine.memory_release import limit_malloc_arenas

limit_malloc_arenas()  # before any thread starts, as `moed serve` and `moed generate` do

import moed.engine.engine_loop as engine_loop  # noqa: E402
from moed.engine.offline_run import run_offline  # noqa: E402
from moed.engine.runtime import open_runtime  # noqa: E402
from moed.engine.sampling import SamplingParams  # noqa: E402
from moed.kernels.numba_runtime import configure_threads  # noqa: E402
from moed.models.moe_transformer import kv_cache_bytes  # noqa: E402

GIB = 2**30


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    configure_threads(args.threads)
    samples: list[tuple[int, MallInfo2]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((rss(), LIBC.mallinfo2()))
            time.sleep(0.02)

    steps: list[int] = []
    forward = engine_loop.run_forward

    def counted_forward(*a):
        out = forward(*a)
        steps.append(LIBC.mallinfo2().uordblks)
        return out

    engine_loop.run_forward = counted_forward  # the engine loop's one call per step
    rt = open_runtime(args.model)
    vocab = rt.model.config.vocab_size
    prompt = [(7 * i + 11) % (vocab - 100) + 50 for i in range(args.prompt)]
    run_offline(rt, [prompt[:16]], [SamplingParams(max_tokens=2, ignore_eos=True)], context_length=64)
    steps.clear()
    threading.Thread(target=sample, daemon=True).start()
    context = args.prompt + args.decode_tokens + 16
    (result,) = run_offline(rt, [prompt], [SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True)],
                            context_length=context)
    done.set()
    held = lambda t: sum(a.nbytes for a in t.arrays) if hasattr(t, "arrays") else t.nbytes  # noqa: E731
    weights = rt.loaded.bank.nbytes() + sum(held(t) for t in rt.loaded.weights.values())
    kv = kv_cache_bytes(rt.model.config, 1, context, rt.model.kv_dtype)
    peak_rss, m = max(samples, key=lambda s: s[0])
    caches = [os.environ.get(v, "default") for v in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")]
    print(f"{args.model}: {args.prompt} tokens, GEMM shape caches (oneDNN, ideep) {caches[0]}, {caches[1]}")
    print(f"weights {weights / GIB:.3f} GiB + K/V {kv / GIB:.3f} GiB; TTFT {result.usage.ttft_s:.1f} s")
    print(f"peak RSS {peak_rss / GIB:.3f} GiB = weights + K/V + {(peak_rss - weights - kv) / GIB:.3f} GiB; "
          f"malloc in use {m.uordblks / GIB:.3f}, free in arenas {m.fordblks / GIB:.3f}, "
          f"mmapped chunks {m.hblkhd / GIB:.3f} GiB")
    print("malloc in use after each step (MiB):", " ".join(f"{b / 2**20:.0f}" for b in steps[:64]))
    rt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
