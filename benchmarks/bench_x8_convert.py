"""How fast a ggml bank is laid out in eights at load: ``ggml_x8_convert`` in place on the native pool, per type.

    .venv/bin/python benchmarks/bench_x8_convert.py [--mb 512]

Each type: a tensor of ``--mb`` MB of random bytes (K 2048; the packing is a byte / bit permutation, it does
not read the values), one warm-up on 64 rows, then one timed in-place conversion. Prints GB/s of the bank.
"""

from __future__ import annotations

import argparse
import time

import torch
from gguf import GGMLQuantizationType as T

from moed.kernels.ggml_rows_format import row_bytes
from moed.kernels.ggml_x8_format import X8_OF
from moed.kernels.native_cpu import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512)
    args = ap.parse_args()
    lib = native()
    if lib is None:
        raise SystemExit("the native CPU kernels are not built (make venv)")
    k = 2048
    for qtype in sorted(X8_OF):
        rb = row_bytes(qtype, k)
        rows = (args.mb << 20) // rb // 8 * 8
        raw = torch.randint(0, 256, (rows, rb), dtype=torch.uint8)
        lib.ggml_x8_convert(raw[:64], qtype, k, pack=True)
        t0 = time.perf_counter()
        lib.ggml_x8_convert(raw, qtype, k, pack=True, out=raw)
        dt = time.perf_counter() - t0
        print(f"{T(qtype).name:8s} {raw.numel() / dt / 1e9:5.2f} GB/s in place ({lib.num_threads} threads)")


if __name__ == "__main__":
    main()
