"""Process-wide settings: frozen dataclasses, and the only place that reads environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """Where moed keeps machine-specific data (calibration profiles): $MOED_CACHE_DIR or XDG cache."""
    explicit = os.environ.get("MOED_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moed"


@dataclass(frozen=True)
class EngineConfig:
    """How the expert engine runs a model (validated once)."""

    device: str = "auto"  # auto | cpu | emulated | cuda
    cache_fraction: float = 0.25  # device expert cache, as a fraction of the expert pool
    policy: str = "adaptive"
    policy_options: tuple[tuple[str, float], ...] = ()
    emulated_b_p: float = 16e9  # emulated device: PCIe expert-copy bandwidth, bytes/s
    emulated_b_dev: float = 900e9  # emulated device: device compute, bytes of weights/s
    adapt_bandwidth: bool = True  # keep re-estimating B_P / B_H from real steps
    cpu_kernel_threads: int | None = None  # numba threads for the CPU branch (None = all cores)

    def __post_init__(self) -> None:
        from moed.errors import InvalidRequestError

        if self.device not in ("auto", "cpu", "emulated", "cuda"):
            raise InvalidRequestError(f"--device {self.device!r}: choose auto, cpu, emulated or cuda")
        if not 0.0 <= self.cache_fraction <= 1.0:
            raise InvalidRequestError(f"--cache-fraction must be between 0 and 1, got {self.cache_fraction}")
        for name, value in (("emulated B_P", self.emulated_b_p), ("emulated device bandwidth", self.emulated_b_dev)):
            if not value > 0:
                raise InvalidRequestError(f"{name} must be positive, got {value}")
