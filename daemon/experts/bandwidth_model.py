"""BandwidthModel: the current B_P (expert copies) and CPU-branch bandwidth, kept up to date.

The split minimises max(q S / B_P', (m - q) S / B_H') where B_P' and B_H' are the rates each
branch reaches *while the other runs*. That gives q = m * B_P' / (B_P' + B_H'). The paper's
linear model says B_H' = B_H - B_P (both branches share one DRAM), which turns this into
q* = m * B_P / B_H; ``current()`` therefore returns (B_P', B_P' + B_H') so that the policies'
q* formula yields the right split whether or not the linear model holds on this machine (on
ours the CPU branch is compute-bound and barely slows down while copies run: see
docs/benchmarks.md). Both rates start from a calibration profile (or defaults) and are
re-estimated from the timings of real steps with an exponential moving average: the paper
measures once, but on a shared desktop a game or a download changes them mid-session.
"""

from __future__ import annotations

import math
import threading

MIN_SAMPLE_BYTES = 256 * 1024  # tiny samples are dominated by fixed overheads: ignore them


class BandwidthModel:
    def __init__(self, b_p: float, b_h_concurrent: float, *, alpha: float = 0.1, adapt: bool = True) -> None:
        for name, value in (("B_P", b_p), ("concurrent B_H", b_h_concurrent)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of bytes/s, got {value!r}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.b_p, self.b_h_concurrent = float(b_p), float(b_h_concurrent)
        self.alpha, self.adapt = alpha, adapt
        self.num_samples_p = self.num_samples_h = 0
        self._lock = threading.Lock()

    @classmethod
    def from_alone(cls, b_p: float, b_h: float, **kw) -> "BandwidthModel":
        """Only the alone-figures are known: assume the paper's linear model, B_H' = B_H - B_P."""
        return cls(b_p, max(b_h - b_p, 0.05 * b_h), **kw)

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        """A device copy of ``nbytes`` took ``seconds`` (transfer alone, not queueing)."""
        if self.adapt and nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
            with self._lock:
                self.b_p += self.alpha * (nbytes / seconds - self.b_p)
                self.num_samples_p += 1

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        """The CPU branch read ``nbytes`` of expert weights in ``seconds``."""
        if self.adapt and nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
            with self._lock:
                self.b_h_concurrent += self.alpha * (nbytes / seconds - self.b_h_concurrent)
                self.num_samples_h += 1

    def current(self) -> tuple[float, float]:
        """(B_P, B_H) to put into q* = m * B_P / B_H."""
        return self.b_p, self.b_p + self.b_h_concurrent
