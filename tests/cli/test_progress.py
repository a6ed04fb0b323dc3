"""The CLI's progress bar (tqdm): bytes, rate and ETA while it runs on a terminal, nothing on a pipe until the
end, one summary line with the elapsed time at the end."""

from __future__ import annotations

import io

from moed.cli import progress as progress_mod
from moed.cli.progress import ProgressBar


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_bytes_and_the_end_a_summary(monkeypatch):
    clock = iter([0.0, 10.0, 20.0] + [20.0] * 20)
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    out = Tty()
    bar = ProgressBar("converting", stream=out)
    bar(2 * 10**9, 8 * 10**9)
    bar(8 * 10**9, 8 * 10**9)
    text = out.getvalue()
    assert "converting" in text and "2.00G/8.00G" in text  # tqdm's bar while it ran
    assert text.rstrip().endswith("converting: 8.00 GB in 20 s")


def test_nothing_is_drawn_on_a_pipe_until_the_end():
    out = io.StringIO()
    bar = ProgressBar("loading", stream=out, min_seconds=0)
    bar(1, 10)
    assert out.getvalue() == ""
    bar(10, 10)
    assert out.getvalue().startswith("loading: ")
