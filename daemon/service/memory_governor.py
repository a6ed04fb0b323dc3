"""The VRAM budget: polls a memory source, applies the user cap, headroom and hysteresis, notifies consumers.

The governor only decides numbers. Consumers (the daemon) get the new budget through `on_budget`
callbacks and schedule the real resize at the engine's next safe point.

Rules: a budget drop (another app grabbed memory, the user lowered the cap) is applied at once;
a rise is applied only after the budget stayed higher by at least the grow margin for
`grow_after_s`, and then to the lowest value seen in that window -- so an app that keeps
grabbing and releasing memory costs one shrink, not a shrink and a grow each time.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import psutil

from moed.errors import InsufficientMemoryError, InvalidRequestError
from moed.service.memory_source import MemoryReading, MemorySource

log = logging.getLogger(__name__)

MiB = 1 << 20
GB = 10**9

BudgetCallback = Callable[["int | None"], None]


@dataclass(frozen=True)
class GovernorConfig:
    """How the governor turns memory readings into a budget (validated once)."""

    poll_interval_s: float = 0.5
    headroom_bytes: int = 512 * MiB  # left free for other apps and the driver
    headroom_fraction: float = 0.0  # of total VRAM; the larger of the two headrooms applies
    shrink_tolerance_bytes: int = 32 * MiB  # drops smaller than this are absorbed by the headroom
    grow_hysteresis_bytes: int = 256 * MiB  # grow only when the budget rose by at least this...
    grow_hysteresis_fraction: float = 0.05  # ...or this fraction of total VRAM, whichever is larger
    grow_after_s: float = 3.0  # ...and stayed there this long
    min_cache_bytes: int = 0  # the expert cache the daemon keeps even under pressure (plan_cache_bytes)

    def __post_init__(self) -> None:
        if not self.poll_interval_s > 0:
            raise InvalidRequestError(f"memory poll interval must be positive, got {self.poll_interval_s} s")
        for name in ("headroom_bytes", "shrink_tolerance_bytes", "grow_hysteresis_bytes", "min_cache_bytes"):
            if getattr(self, name) < 0:
                raise InvalidRequestError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("headroom_fraction", "grow_hysteresis_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InvalidRequestError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.grow_after_s < 0:
            raise InvalidRequestError(f"grow_after_s must be >= 0, got {self.grow_after_s}")

    def headroom(self, total: int) -> int:
        return max(self.headroom_bytes, int(self.headroom_fraction * total))

    def grow_margin(self, total: int) -> int:
        return max(self.grow_hysteresis_bytes, int(self.grow_hysteresis_fraction * total))


def _lt(a: int | None, b: int | None) -> bool:
    """a < b where None means unlimited."""
    return a is not None and (b is None or a < b)


def _min(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


class MemoryGovernor:
    """Keeps the VRAM budget (bytes we may use; None = unlimited) from a polled source.

    `budget()` = min(user cap, total - other apps - headroom), after the hysteresis rules; without
    a GPU it is the user cap (None when there is none). Callbacks run in the governor thread, or in
    the thread that called `set_user_cap` / `poll_once`, one at a time and in order.
    """

    def __init__(self, source: MemorySource, config: GovernorConfig | None = None, *,
                 user_cap_bytes: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.config = config or GovernorConfig()
        self._clock = clock
        self._lock = threading.Lock()  # guards the fields below
        self._dispatch = threading.RLock()  # serialises decide + notify, so callbacks arrive in order
        self._cap_bytes: int | None = None
        self._cap_fraction: float | None = None
        self._set_cap(user_cap_bytes, None)
        self._ours = 0
        self._reading: MemoryReading | None = None
        self._target: int | None = None
        self._pending_since: float | None = None  # when the budget first stood above target + margin
        self._pending_low: int | None = None  # lowest budget seen since then
        self._num_shrinks = 0
        self._num_grows = 0
        self._callbacks: list[BudgetCallback] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error: str | None = None

    # --- consumers -------------------------------------------------------------------------

    def on_budget(self, callback: BudgetCallback) -> None:
        """Call `callback(new_budget_bytes)` whenever the budget changes (not for the first reading:
        read `budget()` after `start()`)."""
        with self._lock:
            self._callbacks.append(callback)

    def budget(self) -> int | None:
        """Bytes of VRAM we may use now (None = no limit: no GPU and no user cap)."""
        self._ensure_first_reading()
        with self._lock:
            return self._target

    def set_ours(self, num_bytes: int) -> None:
        """What the daemon holds on the GPU (weights, cache, KV): used when NVML can't attribute use per process."""
        with self._lock:
            self._ours = max(0, int(num_bytes))

    def set_user_cap(self, cap_bytes: int | None = None, *, fraction: float | None = None) -> None:
        """Set (or clear, with neither argument) the user's cap, in bytes or as a fraction of total VRAM.

        A user's change applies at once in both directions (no hysteresis): they asked for it.
        """
        with self._dispatch:
            with self._lock:
                self._set_cap(cap_bytes, fraction)
                reading = self._reading
            if reading is None:
                self._ensure_first_reading()
                return
            self._apply(reading, force=True)

    def figures(self) -> dict:
        """Numbers for status displays (keys follow moed.v1.MemoryFigures, plus shrink/grow counts)."""
        self._ensure_first_reading()
        vm = psutil.virtual_memory()
        with self._lock:
            r = self._reading
            cap = self._resolved_cap(r)
            source = r.source
            if not r.has_gpu and cap is not None:
                source = "cap"
            return {
                "has_gpu": r.has_gpu,
                "vram_total": r.total,
                "vram_free": r.free,
                "vram_other_apps": r.used_by_others,
                "vram_ours": r.used_by_us,
                "budget_bytes": self._target,
                "cap_bytes": cap,
                "host_total": int(vm.total),
                "host_available": int(vm.available),
                "source": source,
                "num_shrinks": self._num_shrinks,
                "num_grows": self._num_grows,
            }

    # --- the thread --------------------------------------------------------------------------

    def start(self) -> "MemoryGovernor":
        """Take a first reading (so budget() is valid at once) and poll in a background thread."""
        if self._thread is not None:
            return self
        self._ensure_first_reading()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="moed-memory-governor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            self._wake.set()
            thread.join(timeout)

    def close(self) -> None:
        """Stop the thread and release the source (NVML)."""
        self.stop()
        close = getattr(self.source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "MemoryGovernor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.poll_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self.poll_once()

    def poll_once(self) -> None:
        """Read the source once and apply the rules (the thread calls this; tests may too)."""
        with self._dispatch:
            with self._lock:
                ours = self._ours
            try:
                reading = self.source.read(ours)
            except Exception as exc:  # a flaky driver must not kill the governor: keep the last budget
                message = f"{type(exc).__name__}: {exc}"
                if message != self._last_error:
                    log.warning("reading GPU memory from %r failed (%s); keeping the last budget", self.source, message)
                    self._last_error = message
                return
            self._last_error = None
            if self._reading is None:
                with self._lock:
                    self._reading = reading
                    self._target = self._raw_budget(reading)
                return
            self._apply(reading, force=False)

    # --- the rules ---------------------------------------------------------------------------

    def _ensure_first_reading(self) -> None:
        if self._reading is None:
            self.poll_once()
        if self._reading is None:  # the source failed on the very first read: behave as no GPU
            with self._dispatch, self._lock:
                if self._reading is None:
                    self._reading = MemoryReading(0, 0, 0, 0, "none")
                    self._target = self._raw_budget(self._reading)

    def _set_cap(self, cap_bytes: int | None, fraction: float | None) -> None:
        if cap_bytes is not None and fraction is not None:
            raise InvalidRequestError("give the VRAM cap in bytes or as a fraction, not both")
        if cap_bytes is not None and cap_bytes < 0:
            raise InvalidRequestError(f"VRAM cap must be >= 0 bytes, got {cap_bytes}")
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise InvalidRequestError(f"VRAM cap fraction must be in (0, 1], got {fraction}")
        self._cap_bytes = None if cap_bytes is None else int(cap_bytes)
        self._cap_fraction = fraction

    def _resolved_cap(self, reading: MemoryReading | None) -> int | None:
        if self._cap_fraction is not None:
            # a fraction of nothing is no cap: without a GPU there is nothing to take a share of
            return int(self._cap_fraction * reading.total) if reading is not None and reading.has_gpu else None
        return self._cap_bytes

    def _raw_budget(self, reading: MemoryReading) -> int | None:
        """min(user cap, total - other apps - headroom), before hysteresis. Called with _lock held."""
        cap = self._resolved_cap(reading)
        if not reading.has_gpu:
            return cap
        room = max(0, reading.total - reading.used_by_others - self.config.headroom(reading.total))
        return room if cap is None else min(cap, room)

    def _apply(self, reading: MemoryReading, *, force: bool) -> None:
        """Decide on the new target under the lock; notify outside it (still under _dispatch)."""
        cfg = self.config
        now = self._clock()
        with self._lock:
            self._reading = reading
            raw = self._raw_budget(reading)
            old = self._target
            new = old
            if force:
                new = raw
                self._pending_since = self._pending_low = None
            elif _lt(raw, None if old is None else old - cfg.shrink_tolerance_bytes):
                new = raw  # over budget: shrink now
                self._pending_since = self._pending_low = None
            elif old is not None and (raw is None or raw >= old + cfg.grow_margin(reading.total)):
                if self._pending_since is None:
                    self._pending_since, self._pending_low = now, raw
                else:
                    self._pending_low = _min(self._pending_low, raw)
                if now - self._pending_since >= cfg.grow_after_s:
                    new = self._pending_low
                    self._pending_since = self._pending_low = None
            else:  # within the band: nothing to do, and any grow has to start over
                self._pending_since = self._pending_low = None
            if new == old:
                return
            self._target = new
            if _lt(new, old):
                self._num_shrinks += 1
            else:
                self._num_grows += 1
            callbacks = list(self._callbacks)
        log.info("VRAM budget %s -> %s (total %d, other apps %d, ours %d)", _fmt(old), _fmt(new),
                 reading.total, reading.used_by_others, reading.used_by_us)
        for callback in callbacks:
            try:
                callback(new)
            except Exception:
                log.exception("a VRAM budget callback failed")


def _fmt(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "unlimited"
    return f"{num_bytes / GB:.2f} GB"


def plan_cache_bytes(budget: int | None, fixed_bytes: int, kv_bytes: int, *, reserve_bytes: int = 0,
                     min_cache_bytes: int = 0, max_cache_bytes: int | None = None, slot_bytes: int = 1) -> int:
    """Bytes the device expert cache may take: the budget minus non-expert weights, the KV cache and a
    reserve (activations, workspace), rounded down to whole `slot_bytes` (one expert), clamped to
    [min_cache_bytes, max_cache_bytes]. `budget=None` (no limit) gives `max_cache_bytes`.

    `min_cache_bytes` wins over the budget: it is the cache the daemon insists on keeping.
    """
    for name, value in (("fixed_bytes", fixed_bytes), ("kv_bytes", kv_bytes), ("reserve_bytes", reserve_bytes),
                        ("min_cache_bytes", min_cache_bytes)):
        if value < 0:
            raise ValueError(f"plan_cache_bytes: {name} must be >= 0, got {value}")
    if slot_bytes <= 0:
        raise ValueError(f"plan_cache_bytes: slot_bytes must be positive, got {slot_bytes}")
    if budget is None:
        if max_cache_bytes is None:
            raise ValueError("plan_cache_bytes: with no budget, pass max_cache_bytes (e.g. the whole expert pool)")
        room = max_cache_bytes
    else:
        room = budget - fixed_bytes - kv_bytes - reserve_bytes
        if max_cache_bytes is not None:
            room = min(room, max_cache_bytes)
    room = max(0, room) // slot_bytes * slot_bytes
    return max(room, min_cache_bytes)


def format_bytes(num_bytes: int) -> str:
    """Host-memory figures for people: GB with one decimal, or whole MB below 1 GB."""
    if num_bytes >= GB:
        return f"{num_bytes / GB:.1f} GB"
    return f"{math.ceil(num_bytes / 10**6)} MB"


def available_host_bytes() -> int:
    """Host RAM a load may use now: psutil's `available` (free plus reclaimable cache)."""
    return int(psutil.virtual_memory().available)


def check_host_ram(required_bytes: int, *, available_bytes: int | None = None, what: str = "the model") -> None:
    """Raise InsufficientMemoryError when `required_bytes` exceed the host RAM available now
    (psutil's `available`: free plus reclaimable cache)."""
    available = available_host_bytes() if available_bytes is None else int(available_bytes)
    if required_bytes > available:
        raise InsufficientMemoryError(
            f"{what} needs {format_bytes(required_bytes)} of host RAM but {format_bytes(available)} are available; "
            "close other programs or use a smaller expert dtype (--experts-dtype int4)")
