"""kernel_bench's alternation: each kernel pass is paired with the reads just before and after it."""

from __future__ import annotations

import numpy as np
import pytest

from moed.experts import kernel_bench


def test_a_pass_is_paired_with_the_reads_around_it(monkeypatch) -> None:
    # reads of 4 bytes taking 1, 3, 1, 1 s and kernel passes of 8 bytes taking 2, 6, 1 s between
    # them: pass 1 against the mean read time (1 + 3) / 2 = 2 s: (8/2) / (4/2) = 2; pass 2 against
    # (3 + 1) / 2: (8/6) / 2 = 0.67; pass 3 against 1 s: 8 / 4 = 2 -> median 2 (pairing with the
    # read before only would give 1, 1, 2 -> 1)
    buf, buf_4k = np.zeros(1, np.float32), np.zeros(2, np.float32)
    reads = iter([1.0, 3.0, 1.0, 1.0])
    monkeypatch.setattr(kernel_bench, "_read_pass", lambda b: 9.0 if b is buf_4k else next(reads))
    passes = iter([2.0, 6.0, 1.0])
    m = kernel_bench._alternate(lambda: next(passes), buf, buf_4k, trials=3, nbytes=8)
    assert m["best_pass"] == 1.0
    assert m["read_gbps"] == pytest.approx(4 / 1.0 / 1e9)
    assert m["read_4k_gbps"] == pytest.approx(8 / 9.0 / 1e9)
    assert m["paired_ratio"] == pytest.approx(2.0)


def test_an_even_number_of_rounds_takes_the_middle_two(monkeypatch) -> None:
    buf, buf_4k = np.zeros(1, np.float32), np.zeros(1, np.float32)
    monkeypatch.setattr(kernel_bench, "_read_pass", lambda b: 1.0)  # 4 B/s everywhere
    passes = iter([1.0, 2.0])  # 8 and 4 B/s -> ratios 2 and 1
    m = kernel_bench._alternate(lambda: next(passes), buf, buf_4k, trials=2, nbytes=8)
    assert m["paired_ratio"] == pytest.approx(1.5)
