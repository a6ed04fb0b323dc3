"""Cache admission control for the expert cache (control code only: numpy, no tensors).

A miss does not have to be copied into the cache: it can run on the CPU instead, at no extra
copy. So, unlike a classic cache, refusing to admit an expert is free, which is what makes
admission control (TinyLFU, Einziger et al.) fit this system: on a loop larger than the
cache (the per-token working set of all layers exceeds the slots), LRU that admits every miss
evicts exactly the entries that are needed next and misses 100%; an admission filter keeps the
frequent entries resident and runs the rest on the CPU.

- ``FrequencySketch``: an exact use counter per flat id (the id space is small: layers x
  experts), +1 per layer call that requests the id; every ``window_factor * num_ids`` recorded
  requests all counters are halved (TinyLFU's reset), so the counts follow drifting routing.
- ``AdmissionRule``: a sketch plus a bias: a miss ``c`` may take the slot of victim ``v`` only
  if ``freq(c) + bias > freq(v)``. ``bias = 0`` is strict TinyLFU (frequency wins, loops and
  scans cannot flush the cache); a larger bias leans toward recency (``bias = inf``: plain
  LRU, every miss admitted).
- ``AdmissionDuel``: no single rule is best on every trace (strict frequency wins on real
  routing at small caches, a recency-leaning rule wins on drifting high-locality routing), so
  one tag-only shadow cache per rule replays the same requests (same size, same q* quota,
  LRU victims) and counts its misses with exponential decay; the real cache follows the rule
  whose shadow currently misses least (ARC / set-dueling style adaptation, decided from the
  request stream only, so placement never depends on timing).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from moed.cache.expert_cache import ExpertCache


class FrequencySketch:
    """Aged request counts per flat id (TinyLFU's frequency estimate, exact: ids are few)."""

    def __init__(self, window_factor: float = 8.0) -> None:
        if not window_factor > 0:
            raise ValueError(f"frequency sketch window_factor must be > 0, got {window_factor}")
        self.window_factor = float(window_factor)
        self.counts = np.zeros(0, dtype=np.int64)
        self._since_reset = 0

    @property
    def num_ids(self) -> int:
        return len(self.counts)

    def window(self) -> int:
        """Recorded requests between two halvings."""
        return max(int(self.window_factor * max(self.num_ids, 1)), 1)

    def record(self, ids: np.ndarray, num_ids: int) -> None:
        """Count one request of each id (distinct ids of one layer call); age when due."""
        if len(self.counts) != num_ids:
            self.counts = np.zeros(num_ids, dtype=np.int64)
            self._since_reset = 0
        self.counts[ids] += 1
        self._since_reset += len(ids)
        if self._since_reset >= self.window():
            self.counts >>= 1
            self._since_reset //= 2

    def freq(self, ids: np.ndarray | Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64)
        if len(self.counts) == 0:
            return np.zeros(len(arr), dtype=np.int64)
        return self.counts[arr]


class AdmissionRule:
    """Admit miss ``c`` over victim ``v`` iff ``freq(c) + bias > freq(v)``."""

    def __init__(self, window_factor: float = 8.0, bias: float = 0) -> None:
        if not bias >= 0:  # also rejects NaN; math.inf = admit every miss (plain LRU)
            raise ValueError(f"admission bias must be >= 0, got {bias}")
        self.sketch = FrequencySketch(window_factor)
        self.bias = float(bias)

    def __repr__(self) -> str:
        return f"AdmissionRule(window_factor={self.sketch.window_factor:g}, bias={self.bias:g})"

    def choose(self, cache: ExpertCache, misses: np.ndarray, hits: np.ndarray, quota: int,
               evict_order: Callable[[int], list[int]] | None = None) -> tuple[np.ndarray, list[int]]:
        """Fills (and their slots) among ``misses`` (hottest first), at most ``quota``.

        Candidates go by estimated frequency (stable: ties keep ``misses``' order); victims in
        the cache's eviction order, hits protected, free slots first. A free slot is taken
        without a test; an occupied one only if the candidate beats its holder, and the first
        refusal ends the call (the next candidate is no more frequent, the next victim no less
        recently used). Unlike q*'s "at least one fill", this fills nothing when the cache is
        full and no miss passes the test: on a loop a forced fill per layer evicts the only
        useful entries.
        """
        if quota <= 0 or len(misses) == 0:
            return misses[:0], []
        counts = self.sketch.counts
        if len(counts) != cache.num_ids:  # nothing recorded yet: every estimate is 0
            counts = np.zeros(cache.num_ids, dtype=np.int64)
        order = misses[np.argsort(-counts[misses], kind="stable")]
        victims = (evict_order(quota) if evict_order is not None
                   else cache.choose_victims(quota, protect=hits))
        holders = cache.slot_state().slot_ids
        fills: list[int] = []
        slots: list[int] = []
        for cand, slot in zip(order, victims):
            held = int(holders[slot])
            if held >= 0 and not counts[cand] + self.bias > counts[held]:
                break
            fills.append(int(cand))
            slots.append(int(slot))
        return np.asarray(fills, dtype=np.int64), slots


# (window_factor, bias): a recency-leaning rule (short memory, lets a newcomer replace a victim
# up to 2 requests more frequent), strict TinyLFU with a long memory (8 passes over the ids),
# and plain LRU (every miss admitted: the old policy, best on near-uniform routing)
DEFAULT_RULES: tuple[tuple[float, float], ...] = ((1.0, 2.0), (8.0, 0.0), (1.0, math.inf))
DEFAULT_HALF_LIFE = 1.0  # score half-life, in passes over the id space (num_ids requests)


class AdmissionDuel:
    """Picks, call by call, the admission rule whose shadow cache has missed least lately."""

    def __init__(self, rules: Sequence[tuple[float, float]] = DEFAULT_RULES,
                 half_life: float = DEFAULT_HALF_LIFE) -> None:
        if len(rules) < 1:
            raise ValueError("admission duel needs at least one rule")
        if not half_life > 0:
            raise ValueError(f"admission duel half_life must be > 0, got {half_life}")
        self.rules = [AdmissionRule(float(w), float(b)) for w, b in rules]
        self.half_life = float(half_life)
        self.scores = np.zeros(len(self.rules), dtype=np.float64)
        self.leader = 0
        self._shadows: list[ExpertCache] = []

    @property
    def rule(self) -> AdmissionRule:
        """The rule the real cache follows now."""
        return self.rules[self.leader]

    def observe(self, cache: ExpertCache, ids: np.ndarray, counts: np.ndarray,
                quota: Callable[[int], int]) -> AdmissionRule:
        """Record one layer call's distinct ``ids`` (token ``counts``), replay it through every
        shadow (``quota(m)`` fills at most for m misses) and return the leading rule."""
        if len(self._shadows) != len(self.rules) or self._shadows[0].num_ids != cache.num_ids:
            self._shadows = [ExpertCache(cache.num_ids, cache.num_slots) for _ in self.rules]
        elif self._shadows[0].num_slots != cache.num_slots:  # the real cache was resized
            for shadow in self._shadows:
                shadow.resize(cache.num_slots)
        for rule in self.rules:
            rule.sketch.record(ids, cache.num_ids)
        for i, (rule, shadow) in enumerate(zip(self.rules, self._shadows)):
            shadow.advance()
            is_hit = shadow.lookup(ids) >= 0
            hits = ids[is_hit]
            shadow.touch(hits)
            misses, miss_counts = ids[~is_hit], counts[~is_hit]
            by_heat = misses[np.lexsort((misses, -miss_counts))]
            fills, slots = rule.choose(shadow, by_heat, hits, quota(len(misses)))
            shadow.admit(fills, slots)
            self.scores[i] += len(misses)
        self.scores *= 0.5 ** (len(ids) / (self.half_life * cache.num_ids))
        best = int(np.argmin(self.scores))
        if self.scores[best] < self.scores[self.leader]:  # ties keep the leader (no flapping)
            self.leader = best
        return self.rule
