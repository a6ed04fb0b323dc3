"""EngineStats: the expert engine's counters and current figures (what status reports show)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    device: str = "cpu"
    policy: str = "cpu-all"
    hits: int = 0  # routed (layer, expert) lookups found in the device cache
    misses: int = 0
    fills: int = 0  # misses copied into the cache and run on the device
    transient_fills: int = 0  # misses copied into scratch slots, run on the device, not cached
    cpu_experts: int = 0  # misses run on the CPU
    last_q: int = 0
    last_m: int = 0
    b_p: float = 0.0  # bytes/s, current estimate
    b_h: float = 0.0
    cache_slots: int = 0
    cache_bytes: int = 0
    pinned_bytes: int = 0
    pageable_bytes: int = 0
    pin_note: str = ""
    cpu_seconds: float = 0.0  # CPU branch wall time
    copy_seconds: float = 0.0  # transfer time
    device_compute_seconds: float = 0.0  # measured (cuda) or charged by the timing model (emulated)
    modelled_seconds: float = 0.0  # emulated: sum over layers of max(cpu branch, copies + device compute)
    streamed_layers: int = 0  # prefill layer calls run from a streamed layer buffer (experts/prefill_stream.py)
    streamed_bytes: int = 0  # expert bytes those buffers were loaded with
    refill_bytes: int = 0  # expert bytes copied back from the host bank after cache resizes
    model_note: str = ""  # why the non-expert model stayed on the host with a device, if it did
    model_device_bytes: int = 0  # non-expert weights + KV cache resident on the device

    @property
    def miss_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.misses / lookups if lookups else 0.0

    @property
    def q_over_m(self) -> float:
        return self.last_q / self.last_m if self.last_m else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(miss_rate=self.miss_rate, q_over_m=self.q_over_m)
        return out
