"""Trace replay through the real ExpertCache: policies compare as the design says they should."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moed.errors import InvalidRequestError
from moed.experts.policy_replay import replay, run_policy_bench, synthetic_trace
from moed.experts.routing_trace import RoutingTrace, RoutingTraceWriter

LAYERS, EXPERTS, TOP_K = 4, 32, 4


@pytest.fixture(scope="module")
def high_trace() -> RoutingTrace:
    return synthetic_trace("high", LAYERS, EXPERTS, TOP_K, 300, seed=1)


def first_seen_step(trace: RoutingTrace) -> dict[tuple[int, int], int]:
    """(layer, expert) -> index of the step that first routes to it (computed from the records)."""
    first: dict[tuple[int, int], int] = {}
    for index, (_seq, _pos, _phase, by_layer) in enumerate(trace.steps()):
        for layer, experts in by_layer.items():
            for e in experts:
                first.setdefault((layer, e), index)
    return first


def test_synthetic_trace_is_deterministic_and_well_formed():
    a = synthetic_trace("high", 3, 16, 4, 20, seed=5, num_prefill=6)
    b = synthetic_trace("high", 3, 16, 4, 20, seed=5, num_prefill=6)
    c = synthetic_trace("high", 3, 16, 4, 20, seed=6, num_prefill=6)
    assert a.records == b.records and a.records != c.records
    steps = list(a.steps())
    assert len(steps) == 26 and [s[2] for s in steps].count("prefill") == 6
    for _seq, _pos, _phase, by_layer in steps:
        assert sorted(by_layer) == [0, 1, 2]
        for experts in by_layer.values():
            assert len(set(experts)) == 4 and all(0 <= e < 16 for e in experts)
    with pytest.raises(InvalidRequestError, match="kind"):
        synthetic_trace("medium", 3, 16, 4, 20)


def test_high_locality_really_is_more_local_than_uniform():
    def reuse(trace):  # share of experts that the same layer also used on the previous token
        steps = [s[3] for s in trace.steps()]
        shared = sum(len(set(a[layer]) & set(b[layer])) for a, b in zip(steps, steps[1:]) for layer in a)
        return shared / sum(len(b[layer]) for b in steps[1:] for layer in b)

    high = reuse(synthetic_trace("high", LAYERS, EXPERTS, TOP_K, 200, seed=2))
    uniform = reuse(synthetic_trace("uniform", LAYERS, EXPERTS, TOP_K, 200, seed=2))
    assert high > 0.4 and uniform < 0.2  # uniform: about top_k / num_experts = 0.125


def test_replay_counters_add_up(high_trace):
    for policy in ("adaptive", "fixed-share", "static"):
        r = replay(high_trace, policy, cache_fraction=0.25)
        assert r.num_slots == 32  # round(0.25 * 4 * 32)
        assert r.lookups == 300 * LAYERS * TOP_K  # one sequence, distinct experts per token
        assert r.hits + r.misses == r.lookups and r.fills + r.cpu == r.misses
        assert r.miss_rate == pytest.approx(r.misses / r.lookups)
        assert len(r.per_layer_miss_rate) == LAYERS and sum(r.step_misses) == r.misses


def test_lru_adaptive_beats_static_on_high_locality(high_trace):
    adaptive = replay(high_trace, "adaptive", cache_fraction=0.25).miss_rate
    static = replay(high_trace, "static", cache_fraction=0.25).miss_rate
    assert adaptive < 0.5 * static, (adaptive, static)


def test_hot_set_sits_between_lru_and_static():
    trace = synthetic_trace("high", LAYERS, EXPERTS, TOP_K, 200, seed=3, num_prefill=50)
    rates = {p: replay(trace, p, cache_fraction=0.25).miss_rate for p in ("adaptive", "hot-set", "static")}
    assert rates["adaptive"] < rates["hot-set"] < rates["static"], rates


def test_full_cache_misses_only_compulsory(high_trace):
    first = first_seen_step(high_trace)
    fill_all = replay(high_trace, "fill-all", cache_fraction=1.0)
    assert fill_all.misses == len(first)  # every (layer, expert) misses exactly once
    # adaptive fills only q* of each step's misses, so a miss may repeat while warming up; once
    # warm (second half of the trace), the only misses are experts never routed to before
    adaptive = replay(high_trace, "adaptive", cache_fraction=1.0)
    half = len(adaptive.step_misses) // 2
    new_in_second_half = sum(1 for step in first.values() if step >= half)
    assert sum(adaptive.step_misses[half:]) == new_in_second_half
    assert adaptive.misses > fill_all.misses  # the warm-up did cost repeats


@pytest.mark.parametrize("policy", ["adaptive", "fill-all"])
def test_lru_miss_rate_falls_as_the_cache_grows(high_trace, policy):
    rates = [replay(high_trace, policy, cache_fraction=f).miss_rate for f in (0.1, 0.25, 0.5, 1.0)]
    assert all(a > b for a, b in zip(rates, rates[1:])), rates


def test_cpu_all_misses_everything_and_miss_rate_is_decode_only():
    trace = synthetic_trace("high", 2, 8, 2, 10, seed=0, num_prefill=5)
    r = replay(trace, "cpu-all", cache_fraction=0.5)
    assert r.miss_rate == 1.0 and r.fills == 0 and r.lookups == 10 * 2 * 2
    assert r.prefill_lookups > 0 and r.prefill_misses == r.prefill_lookups
    # the 5 prefill positions of one sequence replay as one batched step, then 10 decode steps
    assert len(r.step_misses) == 11
    assert len(replay(trace, "cpu-all", cache_fraction=0.5, prefill_chunk=2).step_misses) == 13


def test_replay_maps_sparse_layer_numbers_and_checks_shapes():
    steps = [(0, pos, "decode", {1: [pos % 3], 5: [2]}) for pos in range(6)]  # dense layers skipped
    trace = RoutingTrace.from_steps(steps, 4)
    r = replay(trace, "fill-all", cache_fraction=1.0)
    assert r.num_slots == 8 and r.misses == 4  # 3 experts of layer 1 + 1 of layer 5
    with pytest.raises(InvalidRequestError, match="num_layers=1"):
        replay(trace, "fill-all", cache_fraction=1.0, num_layers=1)
    with pytest.raises(InvalidRequestError, match="num_experts=2"):
        replay(trace, "fill-all", cache_fraction=1.0, num_experts=2)
    with pytest.raises(InvalidRequestError, match="cache fraction"):
        replay(trace, "fill-all", cache_fraction=1.5)


def test_run_policy_bench_markdown_and_json(tmp_path):
    trace = synthetic_trace("high", 2, 8, 2, 30, seed=0)
    path = tmp_path / "routes.jsonl"
    with RoutingTraceWriter(path) as writer:
        for seq, pos, phase, by_layer in trace.steps():
            writer.write_step(seq, pos, phase, by_layer)
    table = run_policy_bench(path, [0.25, 0.5], ["adaptive", "static"])
    lines = table.splitlines()
    assert lines[0] == "| policy | 25% cache | 50% cache |"
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["adaptive", "static"]
    expected = replay(trace, "static", cache_fraction=0.5).miss_rate
    assert lines[3].endswith(f"| {expected * 100:.1f}% |")

    data = json.loads(run_policy_bench(trace, [0.5], ["fill-all"], json=True))
    assert data["num_layers"] == 2 and data["num_experts"] == 8
    assert data["results"][0]["policy"] == "fill-all" and data["results"][0]["num_slots"] == 8
    assert "step_misses" not in data["results"][0]
    assert run_policy_bench(trace, 0.5, "adaptive, static") == run_policy_bench(trace, [0.5], ["adaptive", "static"])
    with pytest.raises(InvalidRequestError, match="unknown split policies"):
        run_policy_bench(trace, [0.5], ["lru9"])


# ---- the default is robust: within 1 point of the best policy, loops and locality alike -------

BASELINES = ("lru", "fill-all", "static", "hot-set", "fixed-share", "lru-freq")


def loop_trace(layers: int = 8, experts: int = 8, top_k: int = 2, tokens: int = 200, seed: int = 0) -> RoutingTrace:
    """Skewed (Zipf 1.2) top-k routing per layer: every token cycles through all layers, so the
    per-token working set (layers * top_k = 16) exceeds a 10% cache (6 slots): LRU's loop case."""
    rng = np.random.default_rng(seed)
    ranks = [rng.permutation(experts) for _ in range(layers)]
    weights = 1.0 / np.arange(1, experts + 1) ** 1.2
    steps = [(0, pos, "decode", {layer: [int(e) for e in ranks[layer][
        rng.choice(experts, top_k, replace=False, p=weights / weights.sum())]] for layer in range(layers)})
        for pos in range(tokens)]
    return RoutingTrace.from_steps(steps, experts)


@pytest.mark.parametrize("which,fraction", [("loop", 0.1), ("loop", 0.2), ("high", 0.1), ("high", 0.25)])
def test_default_is_within_a_point_of_the_best_policy(which, fraction, high_trace):
    trace = loop_trace() if which == "loop" else high_trace
    rates = {p: replay(trace, p, cache_fraction=fraction).miss_rate for p in ("adaptive",) + BASELINES}
    best = min(rates[p] for p in BASELINES)
    assert rates["adaptive"] <= best + 0.01, rates
    if which == "loop" and fraction == 0.1:
        assert rates["lru"] == 1.0 and rates["adaptive"] < 0.8, rates  # LRU's loop pathology, gone


def test_admission_saves_copies_on_a_loop():
    trace = loop_trace()
    adaptive = replay(trace, "adaptive", cache_fraction=0.1)
    lru = replay(trace, "lru", cache_fraction=0.1)
    assert adaptive.fills < 0.1 * lru.fills and adaptive.cpu > lru.cpu - lru.fills
