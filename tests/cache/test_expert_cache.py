"""ExpertCache: residency table, LRU order, one-pass victim choice, protection, resize, stats."""

from __future__ import annotations

import numpy as np
import pytest

from moed.cache.eviction import LruEviction, LruFrequencyEviction, make_eviction
from moed.cache.expert_cache import ExpertCache


def filled(num_slots: int, ids: list[int], num_ids: int = 100, eviction=None) -> ExpertCache:
    """A cache whose slot i holds ids[i], admitted one per tick in list order (ids[0] oldest)."""
    cache = ExpertCache(num_ids, num_slots, eviction)
    for slot, i in enumerate(ids):
        cache.advance()
        assert cache.admit([i], [slot]) == []
    return cache


def test_empty_cache_lookup_and_counts():
    cache = ExpertCache(10, 4)
    assert cache.num_slots == 4 and cache.num_ids == 10 and cache.num_resident == 0
    assert cache.lookup([0, 9, 3]).tolist() == [-1, -1, -1]
    assert cache.resident_ids() == []
    assert cache.choose_victims(2) == [0, 1]


def test_admit_places_ids_and_lookup_finds_them():
    cache = ExpertCache(10, 4)
    assert cache.admit([7, 2], [1, 3]) == []
    assert cache.lookup([2, 7, 5]).tolist() == [3, 1, -1]
    assert sorted(cache.resident_ids()) == [2, 7]
    assert cache.num_resident == 2


def test_lru_order_touch_refreshes():
    cache = filled(3, [10, 11, 12])
    cache.advance()
    cache.touch([10])  # 11 is now the oldest
    assert cache.choose_victims(1) == [1]
    cache.advance()
    assert cache.admit([13], [1]) == [11]
    assert cache.lookup([11, 13]).tolist() == [-1, 1]
    # next oldest: 12 (slot 2), then 10 (slot 0), then 13 (slot 1)
    assert cache.choose_victims(3) == [2, 0, 1]


def test_within_one_tick_later_ids_count_as_more_recent():
    cache = ExpertCache(20, 3)
    cache.advance()
    cache.admit([5, 6, 7], [0, 1, 2])
    assert cache.choose_victims(3) == [0, 1, 2]
    cache.advance()
    cache.touch([7, 5])  # order: 6 (admitted), 7, 5
    assert cache.choose_victims(3) == [1, 2, 0]


def test_choose_victims_returns_the_k_oldest_in_order():
    ids = list(range(20, 30))  # slot s holds 20 + s
    cache = filled(10, ids)
    # refresh in this order; the never-touched slots 1, 4, 6 stay oldest (in admission order)
    for i in [22, 29, 20, 23, 25, 27, 28]:
        cache.advance()
        cache.touch([i])
    # recency, oldest first: slots 1, 4, 6 (never touched), then 2, 9, 0, 3, 5, 7, 8
    assert cache.choose_victims(4) == [1, 4, 6, 2]
    assert cache.choose_victims(10) == [1, 4, 6, 2, 9, 0, 3, 5, 7, 8]
    assert cache.choose_victims(0) == []


def test_free_slots_come_first():
    cache = ExpertCache(50, 5)
    cache.advance()
    cache.admit([1, 2], [3, 4])
    assert cache.choose_victims(3) == [0, 1, 2]
    assert cache.choose_victims(4) == [0, 1, 2, 3]  # then the LRU occupied slot
    assert cache.choose_victims(9) == [0, 1, 2, 3, 4]  # fewer than asked when short


def test_protect_is_respected():
    cache = filled(4, [40, 41, 42, 43])
    assert cache.choose_victims(1) == [0]
    assert cache.choose_victims(1, protect=[40]) == [1]
    assert cache.choose_victims(3, protect=[41, 40]) == [2, 3]  # only two unprotected slots
    assert cache.choose_victims(2, protect=[40, 41, 42, 43]) == []
    # protecting ids that are not resident changes nothing
    assert cache.choose_victims(2, protect=[99, 7]) == [0, 1]


def test_admit_returns_evicted_ids_and_clears_their_residency():
    cache = filled(3, [1, 2, 3])
    cache.advance()
    assert cache.admit([4, 5], [0, 2]) == [1, 3]
    assert cache.lookup([1, 2, 3, 4, 5]).tolist() == [-1, 1, -1, 0, 2]


def test_errors_name_the_problem():
    cache = filled(2, [1, 2], num_ids=10)
    with pytest.raises(ValueError, match="not resident"):
        cache.touch([3])
    with pytest.raises(ValueError, match="already resident"):
        cache.admit([1], [1])
    with pytest.raises(ValueError, match="outside 0..9"):
        cache.lookup([10])
    with pytest.raises(ValueError, match="distinct"):
        cache.admit([4, 5], [0, 0])
    with pytest.raises(ValueError, match="slot out of range"):
        cache.admit([4], [2])
    with pytest.raises(ValueError, match="2 ids but 1 slots"):
        cache.admit([4, 5], [0])
    with pytest.raises(ValueError):
        ExpertCache(0, 3)
    with pytest.raises(ValueError):
        cache.resize(-1)


def test_resize_shrink_keeps_most_recent_and_moves_into_free_slots():
    cache = filled(6, [60, 61, 62, 63, 64, 65])
    for i in [64, 61, 65]:  # recency, oldest first: 60, 62, 63, 64, 61, 65
        cache.advance()
        cache.touch([i])
    plan = cache.resize(3)
    assert plan.num_slots == 3 and cache.num_slots == 3
    assert plan.dropped == (60, 62, 63)  # least recent first
    # 61 stays in slot 1; 64 (slot 4) and 65 (slot 5) move to the freed slots 0 and 2
    assert plan.moves == ((4, 0), (1, 1), (5, 2))
    assert cache.lookup([60, 61, 62, 63, 64, 65]).tolist() == [-1, 1, -1, -1, 0, 2]
    assert sorted(cache.resident_ids()) == [61, 64, 65]
    # recency moved with the entries: oldest is 64 (slot 0), then 61, then 65
    assert cache.choose_victims(3) == [0, 1, 2]


def test_resize_shrink_with_free_slots_drops_nothing_when_it_fits():
    cache = ExpertCache(50, 6)
    cache.advance()
    cache.admit([7, 8], [2, 5])
    plan = cache.resize(3)
    assert plan.dropped == ()
    assert plan.moves == ((5, 0), (2, 2))  # 7 stays in slot 2; 8 moves down into free slot 0
    assert cache.lookup([7, 8]).tolist() == [2, 0]


def test_resize_grow_keeps_everything_in_place():
    cache = filled(3, [30, 31, 32])
    plan = cache.resize(5)
    assert plan.dropped == () and plan.num_slots == 5
    assert plan.moves == ((0, 0), (1, 1), (2, 2))
    assert cache.lookup([30, 31, 32]).tolist() == [0, 1, 2]
    assert cache.choose_victims(4) == [3, 4, 0, 1]  # new free slots first, then LRU order kept


def test_resize_to_zero_drops_all():
    cache = filled(3, [30, 31, 32])
    plan = cache.resize(0)
    assert plan.moves == () and plan.dropped == (30, 31, 32)
    assert cache.num_resident == 0 and cache.choose_victims(1) == []


def test_stats_count_uses():
    cache = filled(2, [1, 2], num_ids=10)
    cache.advance()
    cache.touch([1, 2])
    cache.advance()
    cache.admit([3], [0])
    cache.resize(1)
    stats = cache.stats()
    assert stats == {"num_ids": 10, "num_slots": 1, "num_resident": 1, "num_free": 0, "tick": 4,
                     "num_touches": 2, "num_admits": 3, "num_evictions": 2, "num_resizes": 1}
    assert all(isinstance(v, int) for v in stats.values())


# ---- eviction strategies ---------------------------------------------------------------------


def test_lru_freq_protects_reused_entries_from_one_off_bursts():
    for eviction, expected in ((LruEviction(), 0), (LruFrequencyEviction(), 1)):
        cache = ExpertCache(100, 4, eviction)
        cache.advance()
        cache.admit([1], [0])
        cache.advance()
        cache.touch([1])  # 1 is reused: used twice
        for i, slot in ((2, 1), (3, 2), (4, 3)):  # one-off experts arrive after it
            cache.advance()
            cache.admit([i], [slot])
        # LRU evicts the reused expert (oldest); lru-freq evicts the oldest one-off instead
        assert cache.choose_victims(1) == [expected]


def test_lru_freq_protection_expires_outside_the_window():
    cache = ExpertCache(100, 4, LruFrequencyEviction(window_factor=1.0))  # window = 4 uses
    cache.advance()
    cache.admit([1], [0])
    cache.touch([1])
    cache.admit([2, 3, 4], [1, 2, 3])
    assert cache.choose_victims(1) == [1]  # 1 was used within the last 4 uses: protected
    cache.touch([2, 3, 4])  # now 1's last use is 6 uses old: no longer protected
    assert cache.choose_victims(1) == [0]


def test_lru_freq_protected_share_is_capped():
    # protected_fraction 0.5 of 4 slots: at most 2 protected, the most recent reused ones
    cache = ExpertCache(100, 4, LruFrequencyEviction(protected_fraction=0.5))
    cache.advance()
    cache.admit([1, 2, 3, 4], [0, 1, 2, 3])
    cache.touch([1, 2, 3])  # all three reused; 1 is the oldest of them, so it is not protected
    # unprotected, LRU order: 4 (used once, stamp 4) then 1 (stamp 5); 2 and 3 stay protected
    assert cache.choose_victims(2) == [3, 0]


def test_make_eviction_registry():
    assert make_eviction("lru").name == "lru"
    assert make_eviction("lru-freq", min_uses=3).min_uses == 3
    with pytest.raises(ValueError, match="unknown eviction"):
        make_eviction("fifo")
    with pytest.raises(ValueError):
        LruFrequencyEviction(protected_fraction=1.5)


def test_victim_choice_matches_a_full_sort():
    rng = np.random.default_rng(3)
    cache = ExpertCache(500, 64)
    cache.advance()
    cache.admit(np.arange(64) + 100, np.arange(64))
    for _ in range(200):
        cache.advance()
        cache.touch(rng.choice(np.arange(64) + 100, 5, replace=False))
    state = cache.slot_state()
    protect = [100, 101, 102]
    expected = [int(s) for s in np.argsort(state.last_use) if cache.slot_state().slot_ids[s] not in protect]
    assert cache.choose_victims(10, protect=protect) == expected[:10]
