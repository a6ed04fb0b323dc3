#!/usr/bin/env python3
"""Prefill attention against a long context: paged key blocks (today) vs the former whole-matrix paths.

    python benchmarks/bench_attention_prefill.py [--depths 0,4096,16384,32256] [--chunk 512] [--json OUT]

One attention layer at Qwen3-30B-A3B's shape (32 query heads, 4 KV heads of 128, bf16 KV pool) prefills
a ``--chunk``-token chunk whose first token sits at each depth. Timed per depth (best of 3):
``paged``: layers/paged_attention.attend_paged reading the pool block by block (what MhaAttention runs);
``sdpa+mask``: the path it replaced for models without sinks (gather all L keys of the row into a
contiguous copy, widen, one SDPA call with a [T, L] boolean mask); ``scores``: the path it replaced for
gpt-oss (sinks): explicit [H, T, L] scores, mask, sink column, softmax. Peak RSS growth per call is
read from /proc (VmHWM reset), Linux only.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from moed.cache.kv_cache import KVCache
from moed.layers import paged_attention as pa
from moed.runner.forward_batch import ForwardBatch

BS = 16


def peak_reset() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    return rss()


def rss(field: str = "VmRSS") -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    return 0


def timed(fn, reps: int = 3) -> tuple[float, int]:
    best, grow = float("inf"), 0
    for _ in range(reps):
        before = peak_reset()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        grow = max(grow, rss("VmHWM") - before) if before >= 0 else -1
    return best, grow


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="0,4096,16384,32256")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    h, hk, dh, t = 32, 4, 128, args.chunk
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        total = depth + t
        blocks = -(-total // BS)
        cache = KVCache([{"k": (hk, dh), "v": (hk, dh)}], blocks, BS, torch.bfloat16)
        cache.entry(0, "k").normal_()
        cache.entry(0, "v").normal_()
        table = list(range(blocks))
        batch = ForwardBatch.from_token_lists([[1] * t], [depth], [0], [table])
        q = torch.randn(1, h, t, dh)
        sinks = torch.randn(h)

        def read_kv(row, j0, j1):
            return tuple(cache.read_range(0, n, batch, row, j0, j1, q.dtype).transpose(0, 1) for n in ("k", "v"))

        def gathered():
            k = cache.read_range(0, "k", batch, 0, 0, total, q.dtype).transpose(0, 1)[None]
            v = cache.read_range(0, "v", batch, 0, 0, total, q.dtype).transpose(0, 1)[None]
            return k, v

        def sdpa_mask():
            k, v = gathered()
            mask = pa.dense_mask([depth], [t], t, total, None)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dh ** -0.5, enable_gqa=True)

        def scores():
            k, v = gathered()
            pa.attend_dense(q, k, v, pa.dense_mask([depth], [t], t, total, None), dh ** -0.5, sinks)

        row = {"depth": depth, "chunk": t}
        for name, fn in (("paged", lambda: pa.attend_paged(q, read_kv, [depth], [t], dh ** -0.5, value_dim=dh)),
                         ("paged_sinks", lambda: pa.attend_paged(q, read_kv, [depth], [t], dh ** -0.5, sinks=sinks,
                                                                 value_dim=dh)),
                         ("sdpa+mask", sdpa_mask), ("scores", scores)):
            seconds, grow = timed(fn)
            row[f"{name}_ms"] = round(seconds * 1e3, 1)
            row[f"{name}_peak_mib"] = grow >> 20 if grow >= 0 else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
