"""Expert-cache eviction strategies: each returns one sort key per slot, lower = evicted first.

A strategy sees the cache's per-slot arrays (a ``SlotState``) and returns a key array; the
cache itself handles free slots and protected ids, so a key only has to order occupied slots.
Keys must be distinct for distinct occupied slots (both strategies here are built on the
cache's use stamps, which are unique), so victim choice is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class SlotState:
    """The cache's per-slot arrays, read-only by contract (strategies must not modify them).

    ``stamp`` counts every use (hit or admit) of any entry; ``last_use`` holds the stamp of a
    slot's latest use, so it orders uses across ticks and, within one tick, by call order.
    """

    slot_ids: np.ndarray  # int32 [S]: flat id held, -1 = free
    last_use: np.ndarray  # int64 [S]: stamp of the latest use (larger = more recent)
    last_tick: np.ndarray  # int64 [S]: advance() tick of the latest use
    use_count: np.ndarray  # int64 [S]: uses since admission (the admission counts as 1)
    admit_tick: np.ndarray  # int64 [S]: tick the current entry was admitted
    tick: int  # the cache's logical clock (one per advance(), i.e. per MoE layer call)
    stamp: int  # the latest stamp handed out


class EvictionStrategy(Protocol):
    name: str

    def key(self, state: SlotState) -> np.ndarray:
        """One key per slot ([S], int64 or float64); lower keys are evicted first."""
        ...


class LruEviction:
    """Least recently used: key = stamp of the last use."""

    name = "lru"

    def key(self, state: SlotState) -> np.ndarray:
        return state.last_use


class LruFrequencyEviction:
    """Segmented LRU (SLRU) with a recency window, computed as a key: frequency protects,
    recency orders.

    An entry is *frequent* when it was used at least ``min_uses`` times since admission (by
    default: admitted, then hit at least once) and its last use is within the recent window,
    the last ``window_factor * num_slots`` cache uses (hits + fills). Frequent entries are
    protected, up to ``protected_fraction`` of the slots (when more qualify, the most recently
    used of them). Every unprotected entry is evicted, in LRU order, before any protected one
    (LRU order again). So a burst of one-off experts (a prefill sweep, a rare token) cycles
    through the unprotected segment without flushing the experts that keep being reused; the
    cap keeps room for newcomers to prove themselves, and the window makes a protected entry
    that stopped being used age out instead of freezing the segment (plain SLRU's failure
    when routing drifts). Stateless: derived from the cache's arrays at each call, so resize
    needs no extra bookkeeping.
    """

    name = "lru-freq"

    def __init__(self, min_uses: int = 2, protected_fraction: float = 0.8, window_factor: float = 4.0) -> None:
        if min_uses < 1:
            raise ValueError(f"lru-freq min_uses must be >= 1, got {min_uses}")
        if not 0.0 <= protected_fraction <= 1.0:
            raise ValueError(f"lru-freq protected_fraction must be in [0, 1], got {protected_fraction}")
        if not window_factor > 0:
            raise ValueError(f"lru-freq window_factor must be > 0, got {window_factor}")
        self.min_uses = int(min_uses)
        self.protected_fraction = float(protected_fraction)
        self.window_factor = float(window_factor)

    def key(self, state: SlotState) -> np.ndarray:
        key = state.last_use.astype(np.int64, copy=True)
        window_start = state.stamp - int(self.window_factor * len(key))
        frequent = (state.slot_ids >= 0) & (state.use_count >= self.min_uses) & (state.last_use > window_start)
        cap = int(self.protected_fraction * len(key))
        candidates = np.flatnonzero(frequent)
        if cap <= 0 or len(candidates) == 0:
            return key
        if len(candidates) > cap:
            # keep the `cap` most recently used frequent entries protected (one partition pass)
            recency = state.last_use[candidates]
            candidates = candidates[np.argpartition(-recency, cap - 1)[:cap]]
        # an offset above every stamp puts the protected segment behind every other entry
        key[candidates] += state.stamp + 1
        return key


EVICTION_NAMES = ("lru", "lru-freq")


def make_eviction(name: str, **opts: object) -> EvictionStrategy:
    """The eviction strategy called ``name`` (one of ``EVICTION_NAMES``)."""
    if name == "lru":
        if opts:
            raise ValueError(f"eviction 'lru' takes no options, got {sorted(opts)}")
        return LruEviction()
    if name == "lru-freq":
        return LruFrequencyEviction(**opts)  # type: ignore[arg-type]
    raise ValueError(f"unknown eviction strategy {name!r}; choose one of {', '.join(EVICTION_NAMES)}")
