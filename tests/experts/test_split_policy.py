"""q* and the split policies: every plan partitions the ids; each policy fills what it says."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moed.cache.eviction import LruFrequencyEviction
from moed.cache.expert_cache import ExpertCache
from moed.errors import InvalidRequestError
from moed.experts.policies import POLICY_NAMES, make_policy, static_placement
from moed.experts.split_policy import SplitPlan, q_star

# ---- q* --------------------------------------------------------------------------------------

# (B_P, B_H, q* for m = 100) from the paper (docs/design.md, Reference);
# q* worked out by hand: 100 * B_P / B_H rounded
MACHINES = [
    (11.8, 47.5, 25),  # RTX 4060 laptop: 24.84 -> 25
    (25.3, 56.7, 45),  # RTX 3090 server: 44.62 -> 45
    (25.1, 63.2, 40),  # RTX 4090 server: 39.72 -> 40
    (52.7, 77.3, 68),  # RTX 5090 server: 68.18 -> 68
    (49.0, 53.8, 91),  # RTX 5090 desktop: 91.08 -> 91
    (51.5, 178.0, 29),  # RTX PRO 6000 workstation: 28.93 -> 29
]


@pytest.mark.parametrize("b_p,b_h,expected", MACHINES)
def test_q_star_on_the_measured_machines(b_p, b_h, expected):
    assert q_star(100, b_p, b_h) == expected


def test_q_star_rounds_half_up():
    assert q_star(10, 1.0, 4.0) == 3  # 2.5 -> 3 (Python's round() would say 2)
    assert q_star(10, 2.4, 10.0) == 2  # 2.4 -> 2
    assert q_star(10, 2.6, 10.0) == 3  # 2.6 -> 3


def test_q_star_fills_at_least_one():
    assert q_star(1, 0.001, 100.0) == 1
    assert q_star(3, 1.0, 10.0) == 1  # 0.3 -> at least one
    assert q_star(0, 1.0, 10.0) == 0


def test_q_star_fills_all_when_host_is_not_faster():
    assert q_star(7, 60.0, 50.0) == 7
    assert q_star(7, 50.0, 50.0) == 7


@pytest.mark.parametrize("b_p,b_h", [(0.0, 50.0), (-1.0, 50.0), (math.nan, 50.0), (math.inf, 50.0),
                                     (10.0, 0.0), (10.0, math.nan), (10.0, -3.0)])
def test_q_star_rejects_bad_bandwidths(b_p, b_h):
    with pytest.raises(ValueError, match="must be a positive finite number"):
        q_star(5, b_p, b_h)
    with pytest.raises(ValueError):
        q_star(0, b_p, b_h)  # checked even when there is nothing to split


def test_q_star_rejects_negative_m():
    with pytest.raises(ValueError, match="misses"):
        q_star(-1, 10.0, 20.0)


# ---- plan invariants -------------------------------------------------------------------------


def check_plan_against_cache(plan: SplitPlan, ids, cache: ExpertCache) -> None:
    plan.check(ids)
    assert cache.lookup(plan.hits).tolist() == list(plan.hit_slots)
    assert cache.lookup(plan.fills).tolist() == list(plan.fill_slots)
    assert all(s < 0 for s in cache.lookup(plan.cpu).tolist())
    assert all(s < 0 for s in cache.lookup(plan.evicted).tolist())
    assert not set(plan.evicted) & set(ids) - set(plan.cpu)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_partitions_the_ids(name):
    num_layers, num_experts = 4, 16
    policy = make_policy(name)
    cache = ExpertCache(num_layers * num_experts, 12, eviction=policy.eviction)
    if hasattr(policy, "prepare"):
        policy.prepare(cache, num_experts, num_layers)
    rng = np.random.default_rng(0)
    for step in range(60):
        phase = "prefill" if step < 5 or 30 <= step < 33 else "decode"
        for layer in range(num_layers):
            ids = layer * num_experts + rng.choice(num_experts, int(rng.integers(1, 8)), replace=False)
            counts = rng.integers(1, 5, len(ids))
            cache.advance()
            plan = policy.plan(cache, ids.tolist(), counts.tolist(), phase=phase, b_p=25.3, b_h=56.7)
            check_plan_against_cache(plan, ids.tolist(), cache)
            assert cache.num_resident <= cache.num_slots


def test_plan_check_catches_a_broken_plan():
    good = SplitPlan(hits=(1,), hit_slots=(0,), fills=(2,), fill_slots=(1,), cpu=(3,), evicted=(), m=2, q=1)
    good.check([3, 2, 1])
    with pytest.raises(ValueError, match="partition"):
        SplitPlan(hits=(1,), hit_slots=(0,), fills=(2,), fill_slots=(1,), cpu=(2,), evicted=(), m=2,
                  q=1).check([1, 2])
    with pytest.raises(ValueError, match="hold a hit"):
        SplitPlan(hits=(1,), hit_slots=(0,), fills=(2,), fill_slots=(0,), cpu=(), evicted=(), m=1,
                  q=1).check([1, 2])


def test_bad_calls_are_rejected():
    policy = make_policy("adaptive")
    cache = ExpertCache(10, 4)
    with pytest.raises(ValueError, match="de-duplicated"):
        policy.plan(cache, [1, 1], [1, 1], phase="decode", b_p=1.0, b_h=2.0)
    with pytest.raises(ValueError, match="phase"):
        policy.plan(cache, [1], [1], phase="generate", b_p=1.0, b_h=2.0)
    with pytest.raises(ValueError, match="token counts"):
        policy.plan(cache, [1, 2], [1], phase="decode", b_p=1.0, b_h=2.0)


# ---- quota policies --------------------------------------------------------------------------


def fills_on_empty_cache(name: str, m: int = 10, **opts) -> tuple[SplitPlan, ExpertCache]:
    policy = make_policy(name, **opts)
    cache = ExpertCache(1000, 100, eviction=policy.eviction)
    cache.advance()
    ids = list(range(m))
    return policy.plan(cache, ids, [1] * m, phase="decode", b_p=25.3, b_h=56.7), cache


def test_adaptive_fill_all_cpu_all_fill_counts():
    adaptive, _ = fills_on_empty_cache("adaptive")  # 10 * 25.3 / 56.7 = 4.46 -> 4
    assert (adaptive.m, adaptive.q, len(adaptive.cpu)) == (10, 4, 6)
    fill_all, _ = fills_on_empty_cache("fill-all")
    assert (fill_all.q, fill_all.cpu) == (10, ())
    cpu_all, cache = fills_on_empty_cache("cpu-all")
    assert (cpu_all.q, len(cpu_all.cpu)) == (0, 10)
    assert cache.num_resident == 0


def test_adaptive_fills_the_hottest_misses_ties_by_id():
    policy = make_policy("adaptive")
    cache = ExpertCache(20, 10)
    cache.advance()
    plan = policy.plan(cache, [5, 3, 9, 7], [1, 4, 4, 2], phase="decode", b_p=1.0, b_h=2.0)  # q = 2
    assert plan.fills == (3, 9)
    assert sorted(plan.cpu) == [5, 7]


def test_adaptive_evicts_lru_and_never_a_hit():
    policy = make_policy("adaptive")
    cache = ExpertCache(20, 3)
    for i, slot in ((1, 0), (2, 1), (3, 2)):  # 1 oldest
        cache.advance()
        cache.admit([i], [slot])
    cache.advance()
    plan = policy.plan(cache, [1, 8], [1, 1], phase="decode", b_p=10.0, b_h=10.0)  # fill all misses
    assert plan.hits == (1,) and plan.fills == (8,)
    assert plan.fill_slots == (1,) and plan.evicted == (2,)  # 1 is a hit: 2 is the LRU victim
    cache.advance()
    # 1 was refreshed by the hit, 8 just filled: the next victim is 3
    assert cache.choose_victims(1) == [2]


def test_fills_stop_when_the_cache_is_full_of_hits():
    policy = make_policy("fill-all")
    cache = ExpertCache(20, 2)
    cache.admit([1, 2], [0, 1])
    cache.advance()
    plan = policy.plan(cache, [1, 2, 3], [1, 1, 1], phase="decode", b_p=1.0, b_h=2.0)
    assert plan.hits == (1, 2) and plan.fills == () and plan.cpu == (3,)


def test_fixed_share_ignores_bandwidth():
    for b_p, b_h in ((1.0, 100.0), (100.0, 1.0)):
        policy = make_policy("fixed-share", cpu_share=0.3)
        cache = ExpertCache(100, 50)
        plan = policy.plan(cache, list(range(10)), [1] * 10, phase="decode", b_p=b_p, b_h=b_h)
        assert (plan.q, len(plan.cpu)) == (7, 3)
    assert fills_on_empty_cache("fixed-share", cpu_share=1.0)[0].q == 0
    assert fills_on_empty_cache("fixed-share", cpu_share=0.0)[0].q == 10
    assert fills_on_empty_cache("fixed-share", m=5, cpu_share=0.5)[0].q == 2  # 5 - round(2.5) = 2


def test_lru_freq_policy_uses_frequency_eviction():
    policy = make_policy("lru-freq", window_factor=2.0)
    assert isinstance(policy.eviction, LruFrequencyEviction)
    assert policy.eviction.window_factor == 2.0
    assert fills_on_empty_cache("lru-freq")[0].q == 4  # same quota as adaptive


def test_lru_freq_victims_follow_its_own_eviction_even_on_an_lru_cache():
    victims = {}
    for name in ("adaptive", "lru-freq"):
        policy = make_policy(name)
        cache = ExpertCache(100, 4)  # built with the default LRU either way
        cache.advance()
        cache.admit([1], [0])
        cache.advance()
        cache.touch([1])  # 1 is reused, then three one-off experts arrive
        cache.admit([2, 3, 4], [1, 2, 3])
        cache.advance()
        victims[name] = policy.plan(cache, [9], [1], phase="decode", b_p=10.0, b_h=10.0).evicted
    assert victims == {"adaptive": (1,), "lru-freq": (2,)}


def test_registry_errors_are_for_people():
    with pytest.raises(InvalidRequestError, match="unknown split policy 'lru2'.*adaptive"):
        make_policy("lru2")
    with pytest.raises(InvalidRequestError, match="does not take options"):
        make_policy("adaptive", cpu_share=0.5)
    with pytest.raises(InvalidRequestError, match="cpu_share"):
        make_policy("fixed-share", cpu_share=1.5)


# ---- static ----------------------------------------------------------------------------------


def test_static_placement_shares_slots_equally():
    assert static_placement(5, 4, 2) == [0, 1, 2, 4, 5]  # layer 0 gets the extra slot
    assert static_placement(6, 4, 2, layout="layers") == [0, 1, 4, 5, 6, 7]  # last layer whole
    profile = [0, 9, 1, 5, 7, 0, 0, 8]  # layer 0 favours 1, 3; layer 1 favours 7, 4
    assert static_placement(4, 4, 2, profile=profile) == [1, 3, 7, 4]
    assert static_placement(100, 4, 2) == list(range(8))


def test_static_loads_its_set_lazily_and_never_changes():
    policy = make_policy("static")
    cache = ExpertCache(8, 4)
    assert policy.prepare(cache, 4, 2) == [0, 1, 4, 5]
    cache.advance()
    plan = policy.plan(cache, [0, 2], [1, 1], phase="decode", b_p=1.0, b_h=2.0)
    assert (plan.fills, plan.cpu) == ((0,), (2,))  # static 0 loaded on first request, 2 on CPU
    cache.advance()
    plan = policy.plan(cache, [0, 2], [1, 1], phase="decode", b_p=1.0, b_h=2.0)
    assert (plan.hits, plan.fills, plan.cpu) == ((0,), (), (2,))
    for _ in range(5):  # lots of non-static traffic never fills anything
        cache.advance()
        plan = policy.plan(cache, [2, 3, 6, 7], [3, 3, 3, 3], phase="decode", b_p=10.0, b_h=10.0)
        assert plan.fills == () and plan.evicted == ()
    cache.advance()
    plan = policy.plan(cache, [1, 4, 5], [1, 1, 1], phase="decode", b_p=1.0, b_h=2.0)
    assert sorted(plan.fills) == [1, 4, 5] and plan.evicted == ()
    assert sorted(cache.resident_ids()) == [0, 1, 4, 5]


def test_static_without_prepare_uses_the_constructor_shape():
    policy = make_policy("static", num_experts=4, num_layers=2)
    cache = ExpertCache(8, 2)
    plan = policy.plan(cache, [0, 1, 4], [1, 1, 1], phase="decode", b_p=1.0, b_h=2.0)
    assert sorted(plan.fills) == [0, 4] and plan.cpu == (1,)


# ---- hot-set ---------------------------------------------------------------------------------


def test_hot_set_is_chosen_from_prefill_usage_and_frozen_during_decode():
    policy = make_policy("hot-set")
    cache = ExpertCache(10, 2)
    cache.advance()
    # prefill: nothing is hot yet, everything runs on the CPU
    plan = policy.plan(cache, [1, 2, 3, 4], [5, 1, 9, 2], phase="prefill", b_p=1.0, b_h=2.0)
    assert plan.fills == () and len(plan.cpu) == 4
    cache.advance()
    plan = policy.plan(cache, [2, 4], [1, 1], phase="prefill", b_p=1.0, b_h=2.0)  # 4 totals 3 now
    # first decode step: hot set = the 2 most used (3: 9 tokens, 1: 5 tokens)
    cache.advance()
    plan = policy.plan(cache, [1, 4], [1, 1], phase="decode", b_p=1.0, b_h=2.0)
    assert policy.hot_ids == [1, 3]
    assert (plan.fills, plan.cpu) == ((1,), (4,))
    for _ in range(5):  # 4 and 5 are used a lot in decode, but the set does not change
        cache.advance()
        plan = policy.plan(cache, [4, 5], [3, 3], phase="decode", b_p=10.0, b_h=10.0)
        assert plan.fills == () and sorted(plan.cpu) == [4, 5]
    cache.advance()
    plan = policy.plan(cache, [3, 4], [1, 1], phase="decode", b_p=1.0, b_h=2.0)
    assert (plan.fills, plan.cpu) == ((3,), (4,))
    assert policy.hot_ids == [1, 3]
    # a new prefill, then decode: the set is re-chosen from that prefill only
    cache.advance()
    policy.plan(cache, [4, 5, 6], [3, 2, 1], phase="prefill", b_p=1.0, b_h=2.0)
    cache.advance()
    plan = policy.plan(cache, [4, 5], [1, 1], phase="decode", b_p=1.0, b_h=2.0)
    assert policy.hot_ids == [4, 5]
    assert sorted(plan.fills) == [4, 5] and sorted(plan.evicted) == [1, 3]


# ---- adaptive's admission filter (moed.cache.admission) --------------------------------------


def test_frequency_sketch_counts_and_halves():
    from moed.cache.admission import FrequencySketch
    sketch = FrequencySketch(window_factor=1.0)  # halve every num_ids = 4 requests
    sketch.record(np.array([0, 1]), 4)
    assert sketch.freq([0, 1, 2]).tolist() == [1, 1, 0]
    sketch.record(np.array([0]), 4)
    sketch.record(np.array([0]), 4)  # 4th request: (3, 1, 0, 0) halves to (1, 0, 0, 0)
    assert sketch.counts.tolist() == [1, 0, 0, 0]
    with pytest.raises(ValueError):
        FrequencySketch(window_factor=0)


def test_admission_rule_free_slots_first_then_frequency_test():
    from moed.cache.admission import AdmissionRule
    rule = AdmissionRule(window_factor=100.0, bias=0)
    cache = ExpertCache(10, 2)
    for ids in ([1], [1], [2], [3]):  # freq: 1 -> 2, 2 -> 1, 3 -> 1
        rule.sketch.record(np.array(ids), 10)
    fills, slots = rule.choose(cache, np.array([3]), np.array([], dtype=np.int64), quota=1)
    assert fills.tolist() == [3] and slots == [0]  # a free slot: no test
    cache.admit([3], [0])
    cache.admit([1], [1])
    cache.advance()
    cache.touch([1])  # LRU victim is now 3 (freq 1)
    fills, _ = rule.choose(cache, np.array([2]), np.array([], dtype=np.int64), quota=1)
    assert fills.tolist() == []  # 2 is not more frequent than 3: runs on the CPU, no copy
    rule.sketch.record(np.array([2]), 10)
    fills, slots = rule.choose(cache, np.array([2]), np.array([], dtype=np.int64), quota=1)
    assert fills.tolist() == [2] and slots == [0]  # now it beats 3
    lru_rule = AdmissionRule(bias=math.inf)
    assert lru_rule.choose(cache, np.array([7]), np.array([], dtype=np.int64), quota=1)[0].tolist() == [7]
    with pytest.raises(ValueError):
        AdmissionRule(bias=-1)


def test_adaptive_refuses_fills_on_a_loop_but_lru_forces_one():
    """Cache of 2, cyclic requests over 4 ids: LRU evicts the next one needed each call."""
    results = {}
    for name in ("adaptive", "lru"):
        policy = make_policy(name)
        cache = ExpertCache(4, 2, eviction=policy.eviction)
        hits = fills = 0
        for step in range(200):
            cache.advance()
            plan = policy.plan(cache, [step % 4], [1], phase="decode", b_p=1.0, b_h=2.0)
            plan.check([step % 4])
            hits, fills = hits + len(plan.hits), fills + plan.q
        results[name] = (hits, fills)
    assert results["lru"] == (0, 200)  # every call misses and copies
    assert results["adaptive"][0] >= 90 and results["adaptive"][1] <= 10  # ~half hit, few copies


def test_admission_duel_follows_the_rule_that_misses_least():
    from moed.cache.admission import AdmissionDuel
    duel = AdmissionDuel(rules=((8.0, 0.0), (1.0, math.inf)))
    cache = ExpertCache(4, 2)
    for step in range(100):  # a loop larger than the cache: strict TinyLFU wins
        duel.observe(cache, np.array([step % 4]), np.array([1]), lambda m: m)
    assert duel.leader == 0 and duel.scores[0] < duel.scores[1]
    with pytest.raises(ValueError):
        AdmissionDuel(rules=())
    with pytest.raises(InvalidRequestError):
        make_policy("adaptive", half_life=0)


def test_q_split_equals_q_star_under_the_linear_model_and_differs_when_branches_are_independent():
    from moed.experts.split_policy import q_split

    # linear model: the CPU branch keeps B_H - B_P while copies run -> the paper's q*
    b_p, b_h = 25.3, 56.7
    assert q_split(100, b_p, b_h - b_p) == q_star(100, b_p, b_h) == 45
    # independent branches (CPU branch not slowed by copies): q = m * B_P / (B_P + B_H), 100*25.3/82 = 30.9
    assert q_split(100, b_p, b_h) == 31
