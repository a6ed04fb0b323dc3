"""The device expert cache's residency table: one slot pool shared by every MoE layer.

Control code only: this class holds which flat expert id (``moe_layer * num_experts +
expert``, as in ``host_bank.py``) sits in which slot and when each slot was last used. It
owns no weights; the data owner (the device side) copies experts into the slots this table
hands out, and applies a ``ResizePlan`` when the pool changes size.

Clock: ``advance()`` moves the logical tick once per MoE layer call; every use (a hit via
``touch`` or a fill via ``admit``) also takes a fresh, strictly increasing stamp, so within a
tick the order in which ids are given breaks ties (a later id counts as more recent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moed.cache.eviction import EvictionStrategy, LruEviction, SlotState


@dataclass(frozen=True)
class ResizePlan:
    """How to carry the pool's contents over to ``num_slots`` slots.

    ``moves`` lists every kept entry as ``(old_slot, new_slot)``, sorted by ``new_slot``; pairs
    with ``old_slot == new_slot`` stay in place. Targets are always slots that are free after
    the drops, so the moves can be applied in place in any order. ``dropped`` are the evicted
    ids, least valuable first.
    """

    moves: tuple[tuple[int, int], ...]
    dropped: tuple[int, ...]
    num_slots: int


def _as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64).reshape(-1)


class ExpertCache:
    """Residency table flat_id <-> slot plus per-slot recency and use counts."""

    def __init__(self, num_ids: int, num_slots: int, eviction: EvictionStrategy | None = None) -> None:
        if num_ids < 1:
            raise ValueError(f"expert cache needs at least one expert id, got num_ids={num_ids}")
        if num_slots < 0:
            raise ValueError(f"expert cache num_slots must be >= 0, got {num_slots}")
        self.num_ids = int(num_ids)
        self.eviction: EvictionStrategy = eviction if eviction is not None else LruEviction()
        self._slot_of = np.full(self.num_ids, -1, dtype=np.int32)  # flat id -> slot
        self._tick = 0
        self._stamp = 0
        self._num_touches = 0
        self._num_admits = 0
        self._num_evictions = 0
        self._num_resizes = 0
        self._alloc_slots(int(num_slots))

    def _alloc_slots(self, n: int) -> None:
        self._id_in_slot = np.full(n, -1, dtype=np.int32)  # slot -> flat id
        self._last_use = np.zeros(n, dtype=np.int64)
        self._last_tick = np.zeros(n, dtype=np.int64)
        self._use_count = np.zeros(n, dtype=np.int64)
        self._admit_tick = np.zeros(n, dtype=np.int64)

    # ---- read side -------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return len(self._id_in_slot)

    @property
    def num_resident(self) -> int:
        return int(np.count_nonzero(self._id_in_slot >= 0))

    @property
    def tick(self) -> int:
        return self._tick

    def lookup(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where it is not resident (int32, same length as ``ids``)."""
        arr = self._check_ids(_as_ids(ids), "lookup")
        return self._slot_of[arr]

    def resident_ids(self) -> list[int]:
        """Resident flat ids, by slot order."""
        return [int(i) for i in self._id_in_slot[self._id_in_slot >= 0]]

    def free_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self._id_in_slot < 0)]

    def slot_state(self) -> SlotState:
        """The arrays eviction strategies read (views: do not modify)."""
        return SlotState(self._id_in_slot, self._last_use, self._last_tick, self._use_count,
                         self._admit_tick, self._tick, self._stamp)

    def eviction_keys(self, eviction: EvictionStrategy | None = None) -> np.ndarray:
        """A fresh float64 copy of the keys per slot (lower = evicted first)."""
        strategy = eviction if eviction is not None else self.eviction
        return np.array(strategy.key(self.slot_state()), dtype=np.float64)

    def stats(self) -> dict[str, int]:
        return {
            "num_ids": self.num_ids,
            "num_slots": self.num_slots,
            "num_resident": self.num_resident,
            "num_free": self.num_slots - self.num_resident,
            "tick": self._tick,
            "num_touches": self._num_touches,
            "num_admits": self._num_admits,
            "num_evictions": self._num_evictions,
            "num_resizes": self._num_resizes,
        }

    # ---- write side ------------------------------------------------------------------------

    def advance(self) -> int:
        """Move the logical clock one tick (call once per MoE layer call); returns the new tick."""
        self._tick += 1
        return self._tick

    def _next_stamps(self, n: int) -> np.ndarray:
        stamps = np.arange(self._stamp + 1, self._stamp + 1 + n, dtype=np.int64)
        self._stamp += n
        return stamps

    def touch(self, ids: Sequence[int] | np.ndarray) -> None:
        """Record a hit on each id (all must be resident): refresh recency, count one use each."""
        arr = self._check_ids(_as_ids(ids), "touch")
        if len(arr) == 0:
            return
        slots = self._slot_of[arr]
        if np.any(slots < 0):
            missing = [int(i) for i in arr[slots < 0][:8]]
            raise ValueError(f"expert cache touch: ids {missing} are not resident; touch only hits")
        # with a repeated id, fancy assignment keeps the last (most recent) stamp
        self._last_use[slots] = self._next_stamps(len(arr))
        self._last_tick[slots] = self._tick
        np.add.at(self._use_count, slots, 1)
        self._num_touches += len(arr)

    def choose_victims(self, k: int, protect: Sequence[int] | np.ndarray = (),
                       eviction: EvictionStrategy | None = None) -> list[int]:
        """Up to ``k`` distinct slots to (re)fill: free slots first (lowest index first), then the
        occupied slots with the lowest eviction keys, in key order, found in one partition pass.
        Slots holding a ``protect``-ed id are never returned. Fewer than ``k`` when short.
        ``eviction`` overrides the cache's strategy for this choice (a policy's own)."""
        if k < 0:
            raise ValueError(f"expert cache choose_victims: k must be >= 0, got {k}")
        if k == 0 or self.num_slots == 0:
            return []
        free = np.flatnonzero(self._id_in_slot < 0)
        if len(free) >= k:
            return [int(s) for s in free[:k]]
        need = k - len(free)
        candidate = self._id_in_slot >= 0
        prot = self._check_ids(_as_ids(protect), "choose_victims protect")
        prot_slots = self._slot_of[prot]
        candidate[prot_slots[prot_slots >= 0]] = False
        num_candidates = int(np.count_nonzero(candidate))
        if num_candidates == 0:
            return [int(s) for s in free]
        key = self.eviction_keys(eviction)
        key[~candidate] = np.inf
        if num_candidates <= need:
            chosen = np.flatnonzero(candidate)
        else:
            chosen = np.argpartition(key, need - 1)[:need]
        chosen = chosen[np.lexsort((chosen, key[chosen]))]  # key order, slot index breaks ties
        return [int(s) for s in free] + [int(s) for s in chosen]

    def admit(self, ids: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> list[int]:
        """Place each id in the matching slot (a use: recency refreshed, count = 1); returns the
        ids evicted from those slots. Ids must be distinct and not yet resident; slots distinct."""
        arr = self._check_ids(_as_ids(ids), "admit")
        sl = np.asarray(slots, dtype=np.int64).reshape(-1)
        if len(arr) != len(sl):
            raise ValueError(f"expert cache admit: {len(arr)} ids but {len(sl)} slots")
        if len(arr) == 0:
            return []
        if len(np.unique(arr)) != len(arr) or len(np.unique(sl)) != len(sl):
            raise ValueError("expert cache admit: ids and slots must each be distinct")
        if sl.min() < 0 or sl.max() >= self.num_slots:
            raise ValueError(f"expert cache admit: slot out of range 0..{self.num_slots - 1}: {sl.tolist()}")
        if np.any(self._slot_of[arr] >= 0):
            already = [int(i) for i in arr[self._slot_of[arr] >= 0][:8]]
            raise ValueError(f"expert cache admit: ids {already} are already resident; admit only misses")
        old = self._id_in_slot[sl]
        evicted = old[old >= 0]
        self._slot_of[evicted] = -1
        self._id_in_slot[sl] = arr
        self._slot_of[arr] = sl
        self._last_use[sl] = self._next_stamps(len(arr))
        self._last_tick[sl] = self._tick
        self._use_count[sl] = 1
        self._admit_tick[sl] = self._tick
        self._num_admits += len(arr)
        self._num_evictions += len(evicted)
        return [int(i) for i in evicted]

    def resize(self, num_slots: int) -> ResizePlan:
        """Change the pool to ``num_slots`` slots. Growing keeps every entry in place; shrinking
        keeps the entries with the highest eviction keys (most valuable) and drops the rest.
        Kept entries above the new size move down into the lowest free slots."""
        n = int(num_slots)
        if n < 0:
            raise ValueError(f"expert cache resize: num_slots must be >= 0, got {num_slots}")
        occupied = np.flatnonzero(self._id_in_slot >= 0)
        if len(occupied) > n:
            key = self.eviction_keys()[occupied]
            order = occupied[np.lexsort((occupied, key))]  # least valuable first
            dropped_slots, kept = order[: len(occupied) - n], order[len(occupied) - n:]
        else:
            dropped_slots, kept = occupied[:0], occupied
        dropped = self._id_in_slot[dropped_slots]
        stay = np.sort(kept[kept < n])
        movers = np.sort(kept[kept >= n])
        taken = np.zeros(n, dtype=bool)
        taken[stay] = True
        targets = np.flatnonzero(~taken)[: len(movers)]
        old_slots = np.concatenate([stay, movers])
        new_slots = np.concatenate([stay, targets])

        arrays = (self._id_in_slot, self._last_use, self._last_tick, self._use_count, self._admit_tick)
        self._alloc_slots(n)
        for new, old in zip((self._id_in_slot, self._last_use, self._last_tick, self._use_count,
                             self._admit_tick), arrays):
            new[new_slots] = old[old_slots]
        self._slot_of[dropped] = -1
        self._slot_of[self._id_in_slot[new_slots]] = new_slots
        self._num_evictions += len(dropped)
        self._num_resizes += 1
        order = np.argsort(new_slots, kind="stable")
        moves = tuple((int(o), int(s)) for o, s in zip(old_slots[order], new_slots[order]))
        return ResizePlan(moves=moves, dropped=tuple(int(i) for i in dropped), num_slots=n)

    # ---- helpers ---------------------------------------------------------------------------

    def _check_ids(self, arr: np.ndarray, what: str) -> np.ndarray:
        if len(arr) and (arr.min() < 0 or arr.max() >= self.num_ids):
            bad = [int(i) for i in arr[(arr < 0) | (arr >= self.num_ids)][:8]]
            raise ValueError(f"expert cache {what}: flat ids {bad} are outside 0..{self.num_ids - 1}")
        return arr
