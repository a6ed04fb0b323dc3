"""Trace replay through the real ExpertCache: policies compare as the design says they should."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moed.cli.main import main
from moed.errors import InvalidRequestError
from moed.experts.policy_replay import replay, run_policy_bench, synthetic_trace
from moed.experts.routing_trace import RoutingTrace, RoutingTraceWriter, read_routing_trace

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


# ---- replay order: execution order (sequence as first seen, position, layer), not file order ----


def write_records(path, records):
    """One JSON line per (seq, pos, layer, experts, phase) tuple, in the order given."""
    with RoutingTraceWriter(path) as writer:
        for seq, pos, layer, experts, phase in records:
            writer.write(seq, pos, layer, experts, phase)
    return path


def test_layer_major_file_replays_token_by_token_under_lru(tmp_path):
    # 2 layers x 4 experts, top-1, 6 decode tokens of one sequence; name A<e> / B<e> the
    # experts of layer 0 / layer 1. Layer 0 cycles 0,1,2; layer 1 mostly stays on 3.
    layer0, layer1 = [0, 1, 2, 0, 1, 2], [3, 3, 0, 3, 3, 0]
    records = [("s", pos, 0, [e], "decode") for pos, e in enumerate(layer0)]  # layer-major: all of
    records += [("s", pos, 1, [e], "decode") for pos, e in enumerate(layer1)]  # layer 0, then layer 1
    path = write_records(tmp_path / "layer_major.jsonl", records)
    # cache_fraction 0.375 of 2 * 4 = 3 slots. Top-1: m <= 1 per layer call, so q* = m and
    # "lru" fills every miss into the least recently used slot (cache shown LRU first).
    # Execution order, token by token:  A0 B3 A1 B3 A2 B0 A0 B3 A1 B3 A2 B0
    #   A0 miss [A0]         B3 miss [A0 B3]      A1 miss [A0 B3 A1]   B3 hit  [A0 A1 B3]
    #   A2 miss -A0 [A1 B3 A2]  B0 miss -A1 [B3 A2 B0]  A0 miss -B3 [A2 B0 A0]  B3 miss -A2 [B0 A0 B3]
    #   A1 miss -B0 [A0 B3 A1]  B3 hit  [A0 A1 B3]      A2 miss -A0 [A1 B3 A2]  B0 miss -A1 [B3 A2 B0]
    #   -> 10 misses of 12 lookups: layer 0 misses 6 of 6, layer 1 misses 4 of 6 (hits at t1, t4).
    # File order (the old replay) would be A0 A1 A2 A0 A1 A2 B3 B3 B0 B3 B3 B0:
    #   A0 A1 A2 miss, A0 A1 A2 hit, B3 miss -A0, B3 hit, B0 miss -A1, B3 B3 B0 hit -> 5 misses of 12.
    r = replay(read_routing_trace(path, num_experts=4), "lru", cache_fraction=0.375)
    assert r.num_slots == 3 and r.lookups == 12
    assert (r.misses, r.hits, r.fills, r.cpu) == (10, 2, 10, 0)
    assert r.misses != 5  # what file-order replay gives (computed above)
    assert r.per_layer_miss_rate == pytest.approx((1.0, 4 / 6))
    assert r.step_misses == (2, 1, 2, 2, 1, 2)  # per token, from the walk above


def bench_trace() -> RoutingTrace:
    """Two sequences (prefill + decode), 3 layers x 8 experts, top-2."""
    a = synthetic_trace("high", 3, 8, 2, 24, seed=4, num_prefill=5)
    b = synthetic_trace("low", 3, 8, 2, 16, seed=5, num_prefill=3)
    steps = [("a", pos, phase, by_layer) for _seq, pos, phase, by_layer in a.steps()]
    steps += [(7, pos, phase, by_layer) for _seq, pos, phase, by_layer in b.steps()]
    return RoutingTrace.from_steps(steps, 8)


def test_bench_policy_gives_the_same_miss_rates_for_layer_major_and_shuffled_files(tmp_path, capsys):
    trace = bench_trace()
    token_major = [(r.seq, r.token_pos, r.layer, list(r.experts), r.phase) for r in trace.records]
    layer_major = sorted(token_major, key=lambda rec: rec[2])  # stable: every token of layer 0 first
    assert layer_major != token_major and layer_major[1][:3] == ("a", 1, 0)
    shuffled = [token_major[i] for i in np.random.default_rng(0).permutation(len(token_major))]
    first_a = next(i for i, rec in enumerate(shuffled) if rec[0] == "a")
    shuffled.insert(0, shuffled.pop(first_a))  # "a" still mentioned first: same sequence order
    outputs = {}
    for name, records in [("token", token_major), ("layer", layer_major), ("shuffled", shuffled)]:
        path = write_records(tmp_path / f"{name}.jsonl", records)
        assert main(["bench", "policy", "--trace", str(path), "--json", "--num-experts", "8"]) == 0
        outputs[name] = json.loads(capsys.readouterr().out)["results"]
    assert outputs["layer"] == outputs["token"] and outputs["shuffled"] == outputs["token"]
    rates = {(r["policy"], r["cache_fraction"]): r["miss_rate"] for r in outputs["token"]}
    assert {p for p, _ in rates} >= set(BASELINES) | {"adaptive", "cpu-all"}
    assert len(set(rates.values())) > 5  # not a degenerate trace where every policy agrees
    # the token-major file replays exactly as the in-memory trace it was written from
    assert rates["lru", 0.25] == replay(trace, "lru", cache_fraction=0.25).miss_rate


def test_prefill_chunks_are_consecutive_positions_whatever_the_file_order(tmp_path):
    trace = bench_trace()  # "a": 5 prefill + 24 decode, 7: 3 prefill + 16 decode
    records = [(r.seq, r.token_pos, r.layer, list(r.experts), r.phase) for r in trace.records]
    layer_major = read_routing_trace(write_records(tmp_path / "lm.jsonl", sorted(records, key=lambda rec: rec[2])))
    for chunk, num_steps in [(None, 1 + 24 + 1 + 16), (2, 3 + 24 + 2 + 16), (1, 5 + 24 + 3 + 16)]:
        expected = replay(trace, "cpu-all", cache_fraction=0.5, prefill_chunk=chunk)
        got = replay(layer_major, "cpu-all", cache_fraction=0.5, prefill_chunk=chunk)
        assert len(got.step_misses) == num_steps and got == expected, chunk


def test_sequences_replay_in_the_order_the_file_first_mentions_them(tmp_path):
    # one layer; "b" is mentioned first, and the two sequences' records are interleaved
    records = [("b", 1, 0, [1], "decode"), ("a", 0, 0, [1], "decode"),
               ("b", 0, 0, [0], "decode"), ("a", 1, 0, [2], "decode")]
    trace = read_routing_trace(write_records(tmp_path / "t.jsonl", records), num_experts=4)
    # fill-all with room for everything: a step misses only experts never seen before.
    #   execution order b0 [0], b1 [1], a0 [1], a1 [2] -> 1, 1, 0, 1
    #   (ids sorted, a first: a0 [1], a1 [2], b0 [0], b1 [1] -> 1, 1, 1, 0; file order: 1, 0, 1, 1)
    assert replay(trace, "fill-all", cache_fraction=1.0).step_misses == (1, 1, 0, 1)


def test_a_rerun_sequence_replays_as_a_second_pass(tmp_path):
    # sequence "r" prefilled twice (same positions and layers), layer-major within each run
    run = [("r", pos, layer, [layer + pos], "prefill") for layer in (0, 1) for pos in (0, 1, 2)]
    trace = read_routing_trace(write_records(tmp_path / "t.jsonl", run + run), num_experts=4)
    # two prefill chunks of 3 positions (not one chunk of 6, not one of 3 with doubled experts)
    r = replay(trace, "cpu-all", cache_fraction=0.5)
    assert r.prefill_lookups == 2 * (3 + 3) and len(r.step_misses) == 2
    # full cache, fill-all: the first pass misses its 6 distinct experts, the second none
    assert replay(trace, "fill-all", cache_fraction=1.0).step_misses == (6, 0)
