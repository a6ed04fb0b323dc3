"""The progress bar: bytes, rate and an ETA while running; the elapsed time at the end."""

from __future__ import annotations

import io

from moed.cli import progress as progress_mod
from moed.cli.progress import ProgressBar


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_bytes_rate_eta_then_elapsed(monkeypatch):
    clock = iter([0.0, 10.0, 20.0])
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    out = Tty()
    bar = ProgressBar("converting", stream=out)
    bar(2 * 10**9, 8 * 10**9)  # 2 GB in 10 s: 0.2 GB/s, 6 GB left -> 30 s
    bar(8 * 10**9, 8 * 10**9)
    first, last = out.getvalue().split("\r")
    assert "2.00/8.00 GB" in first and "0.20 GB/s" in first and "ETA 30 s" in first
    assert last.rstrip().endswith("in 20 s") and "100.0%" in last


def test_nothing_is_drawn_on_a_pipe_until_the_end():
    out = io.StringIO()
    bar = ProgressBar("loading", stream=out, min_seconds=0)
    bar(1, 10)
    assert out.getvalue() == ""
    bar(10, 10)
    assert "100.0%" in out.getvalue()
