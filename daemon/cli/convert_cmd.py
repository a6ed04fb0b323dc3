"""`moed convert SRC DST`: write an FTW model (atomically) from a Hugging Face directory."""

from __future__ import annotations

import argparse
import time

from moed.cli.progress import ProgressBar
from moed.weights.converter import convert_model


def run_convert(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    dst = convert_model(args.src, args.dst, experts_dtype=args.experts_dtype, overwrite=args.force,
                        progress=ProgressBar("writing"))
    print(f"wrote {dst} ({args.experts_dtype} experts) in {time.perf_counter() - started:.1f} s")
    return 0
