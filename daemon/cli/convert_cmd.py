"""`moed convert SRC DST`: write an FTW model (atomically) from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moed.cli.progress import ProgressBar
from moed.weights.converter import convert_model


def run_convert(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    dst = convert_model(args.src, args.dst, experts_dtype=args.experts_dtype, overwrite=args.force,
                        progress=ProgressBar("writing"), on_stale_removed=report_stale)
    from moed.weights.ftw_reader import read_ftw_index

    dtype = read_ftw_index(dst).metadata.get("bank", {}).get("dtype", "?")
    print(f"wrote {dst} ({dtype} experts) in {time.perf_counter() - started:.1f} s")
    return 0


def report_stale(path: Path, size: int, pid: int) -> None:
    shown = f"{size / 1e6:.1f} MB" if size < 100e6 else f"{size / 1e9:.2f} GB"
    print(f"moed: removed {path} ({shown}), the temp directory of a conversion that was killed "
          f"(pid {pid} is gone)", file=sys.stderr, flush=True)
