"""Progress of long CLI work (convert, load, pull) as a tqdm bar on stderr: bytes, rate and ETA while it runs
(on a terminal; nothing on a pipe), one summary line at the end either way.

``ProgressBar(label)`` is the ``progress(done, total)`` callback the loaders and the converter take.
"""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self, label: str, *, min_seconds: float = 0.5, stream=None) -> None:
        self.label, self.min_seconds = label, min_seconds
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self.shown = False
        self._bar = None
        self._done = 0

    def __call__(self, done: int, total: int) -> None:
        elapsed = time.perf_counter() - self.started
        if done < total and (elapsed < self.min_seconds or not _is_tty(self.stream)):
            return
        if self._bar is None and done < total:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=self.label, file=self.stream,
                             leave=False, dynamic_ncols=True)
            self._done = done
        elif self._bar is not None:
            self._bar.total = total
            self._bar.update(done - self._done)
            self._done = done
        if done >= total:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self.stream.write(f"{self.label}: {total / 1e9:.2f} GB in {_duration(elapsed)}\n")
            self.stream.flush()
        self.shown = True


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
