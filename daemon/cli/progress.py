"""A one-line progress bar on stderr for long loads (shown only on a terminal or when forced)."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, label: str, *, min_seconds: float = 0.5, stream=None) -> None:
        self.label, self.min_seconds = label, min_seconds
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self.started
        if elapsed < self.min_seconds and done < total:
            return
        if not self.stream.isatty() and done < total:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        rate = done / elapsed / 1e9 if elapsed > 0 else 0.0
        end = "\n" if done >= total else "\r"
        if done >= total:
            tail = f"in {_duration(elapsed)}"
        else:
            tail = f"ETA {_duration((total - done) / (rate * 1e9))}" if rate > 0 else "ETA ?"
        self.stream.write(f"{self.label} [{bar:<30}] {frac * 100:5.1f}% {done / 1e9:.2f}/{total / 1e9:.2f} GB "
                          f"{rate:.2f} GB/s {tail}   {end}")
        self.stream.flush()
        self.shown = True


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
