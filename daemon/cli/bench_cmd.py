"""`moed bench kernels`: this machine's host read bandwidth and the CPU expert kernels' GB/s."""

from __future__ import annotations

import argparse
import json

from moed.errors import InvalidRequestError


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            hidden, inter = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise InvalidRequestError(f"--shapes: {part!r} is not DxI (for example 2048x768)") from None
        if hidden <= 0 or inter <= 0:
            raise InvalidRequestError(f"--shapes: {part!r} needs positive sizes")
        shapes.append((hidden, inter))
    return shapes


def run_bench(args: argparse.Namespace) -> int:
    from moed.experts.kernel_bench import bench_kernels, format_table

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("fp32", "bf16", "int4")]
    if bad or not dtypes:
        raise InvalidRequestError(f"--dtypes: {bad or dtypes} not among fp32, bf16, int4")
    shapes = parse_shapes(args.shapes)
    for hidden, inter in shapes:
        if "int4" in dtypes and (hidden % 32 or inter % 32):
            raise InvalidRequestError(f"--shapes: int4 needs D and I to be multiples of 32, got {hidden}x{inter}")
    rows = bench_kernels(shapes, dtypes)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0
