"""Replays a routing trace through the real ExpertCache and a split policy; synthetic traces; the policy bench.

No model and no tensors: the trace's records replay in execution order whatever order the file
holds them in (sequences as first seen, then token position, then layer; see
``RoutingTrace.steps``), each step being one scheduler step (a decode token, or a chunk of
consecutive prefill positions of one sequence); for each MoE layer of it, in layer order, the
cache clock advances once and the policy plans the step's unique experts of that layer.
"""

from __future__ import annotations

import json as _json
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from moed.cache.expert_cache import ExpertCache
from moed.errors import InvalidRequestError
from moed.experts.policies import POLICY_NAMES, make_policy
from moed.experts.routing_trace import RoutingTrace, Step, read_routing_trace
from moed.experts.split_policy import round_half_up

# RTX 5090 server in the paper (GB/s): q*/m = 0.68
DEFAULT_B_P = 52.7
DEFAULT_B_H = 77.3
DEFAULT_CACHE_FRACTIONS = (0.10, 0.25, 0.50)
SYNTHETIC_KINDS = ("high", "low", "uniform")


@dataclass(frozen=True)
class ReplayResult:
    """Counters over decode-phase layer calls (a trace without phases is all decode);
    ``lookups`` counts unique (step, layer, expert) requests, ``hits + misses == lookups``,
    ``fills + cpu == misses``. ``step_misses`` is per replayed step, all phases."""

    policy: str
    cache_fraction: float
    num_slots: int
    lookups: int
    hits: int
    misses: int
    fills: int
    cpu: int
    miss_rate: float
    per_layer_miss_rate: tuple[float, ...]
    prefill_lookups: int
    prefill_misses: int
    prefill_fills: int
    step_misses: tuple[int, ...]

    def summary(self) -> dict:
        """JSON-ready counters (without the per-step series)."""
        d = asdict(self)
        d.pop("step_misses")
        d["per_layer_miss_rate"] = list(self.per_layer_miss_rate)
        return d


def _batched_steps(trace: RoutingTrace, prefill_chunk: int | None) -> Iterator[tuple[str, dict[int, list[int]]]]:
    """The trace's steps in execution order (``RoutingTrace.steps``): decode positions one by one;
    prefill positions merged into chunks of consecutive positions of one sequence (a run of it)
    of at most ``prefill_chunk`` positions (unlimited when None)."""
    pending: dict[int, list[int]] | None = None
    pending_seq, pending_pos, pending_len = None, 0, 0
    for seq, pos, phase, by_layer in trace.steps():
        if phase == "prefill":
            if pending is not None and (seq != pending_seq or pos != pending_pos + 1
                                        or (prefill_chunk and pending_len >= prefill_chunk)):
                yield "prefill", pending
                pending = None
            if pending is None:
                pending, pending_seq, pending_len = {}, seq, 0
            for layer, experts in by_layer.items():
                pending.setdefault(layer, []).extend(experts)
            pending_pos, pending_len = pos, pending_len + 1
            continue
        if pending is not None:
            yield "prefill", pending
            pending = None
        yield phase, by_layer
    if pending is not None:
        yield "prefill", pending


def replay(trace: RoutingTrace, policy_name: str, *, cache_fraction: float,
           num_layers: int | None = None, num_experts: int | None = None,
           b_p: float = DEFAULT_B_P, b_h: float = DEFAULT_B_H,
           prefill_chunk: int | None = None, **opts: object) -> ReplayResult:
    """Run ``policy_name`` (with ``opts``) over ``trace`` with a cache of
    round(cache_fraction * num_layers * num_experts) slots. Trace layer numbers are mapped to
    MoE-layer indices by rank (so a trace that skips dense layers still packs densely)."""
    if not 0.0 <= cache_fraction <= 1.0:
        raise InvalidRequestError(f"cache fraction must be in [0, 1], got {cache_fraction}")
    layers = trace.layers
    num_layers = num_layers if num_layers is not None else max(len(layers), 1)
    num_experts = num_experts if num_experts is not None else trace.num_experts
    if len(layers) > num_layers:
        raise InvalidRequestError(f"the trace has {len(layers)} distinct layers but num_layers={num_layers}")
    largest = max((max(r.experts) for r in trace.records if r.experts), default=-1)
    if largest >= num_experts:
        raise InvalidRequestError(f"the trace routes to expert {largest} but num_experts={num_experts}")
    moe_index = {layer: i for i, layer in enumerate(layers)}

    policy = make_policy(policy_name, **opts)
    num_slots = round_half_up(cache_fraction * num_layers * num_experts)
    cache = ExpertCache(num_layers * num_experts, num_slots, eviction=policy.eviction)
    prepare = getattr(policy, "prepare", None)
    if prepare is not None:
        prepare(cache, num_experts, num_layers)

    layer_lookups = np.zeros(num_layers, dtype=np.int64)
    layer_misses = np.zeros(num_layers, dtype=np.int64)
    totals = {"hits": 0, "fills": 0, "cpu": 0, "prefill_lookups": 0, "prefill_misses": 0, "prefill_fills": 0}
    step_misses: list[int] = []
    for phase, by_layer in _batched_steps(trace, prefill_chunk):
        misses_this_step = 0
        for layer in sorted(by_layer):
            li = moe_index[layer]
            ids, counts = np.unique(np.asarray(by_layer[layer], dtype=np.int64), return_counts=True)
            cache.advance()
            plan = policy.plan(cache, ids + li * num_experts, counts, phase=phase, b_p=b_p, b_h=b_h)
            misses_this_step += plan.m
            if phase == "decode":
                layer_lookups[li] += len(ids)
                layer_misses[li] += plan.m
                totals["hits"] += len(plan.hits)
                totals["fills"] += plan.q
                totals["cpu"] += len(plan.cpu)
            else:
                totals["prefill_lookups"] += len(ids)
                totals["prefill_misses"] += plan.m
                totals["prefill_fills"] += plan.q
        step_misses.append(misses_this_step)

    lookups, misses = int(layer_lookups.sum()), int(layer_misses.sum())
    per_layer = tuple(float(m / n) if n else 0.0 for m, n in zip(layer_misses, layer_lookups))
    return ReplayResult(policy=policy_name, cache_fraction=float(cache_fraction), num_slots=num_slots,
                        lookups=lookups, hits=totals["hits"], misses=misses, fills=totals["fills"],
                        cpu=totals["cpu"], miss_rate=misses / lookups if lookups else 0.0,
                        per_layer_miss_rate=per_layer, prefill_lookups=totals["prefill_lookups"],
                        prefill_misses=totals["prefill_misses"], prefill_fills=totals["prefill_fills"],
                        step_misses=tuple(step_misses))


def synthetic_trace(kind: str, num_layers: int, num_experts: int, top_k: int, num_tokens: int,
                    seed: int = 0, *, num_prefill: int = 0, history: int = 4) -> RoutingTrace:
    """A one-sequence trace of ``num_prefill`` prefill then ``num_tokens`` decode positions.

    Each layer picks ``top_k`` distinct experts per token. ``high``: each pick comes with
    probability 0.8 from the experts this layer used in the last ``history`` tokens (a slowly
    drifting preferred subset), otherwise from the layer's skewed popularity (Zipf, s = 1, over
    a random order of its experts). ``low``: reuse probability 0.2, 2-token history, milder
    popularity (s = 0.3): near uniform. ``uniform``: independent uniform picks.
    Deterministic in ``seed``.
    """
    if kind not in SYNTHETIC_KINDS:
        raise InvalidRequestError(f"synthetic trace kind must be one of {SYNTHETIC_KINDS}, got {kind!r}")
    if not 1 <= top_k <= num_experts:
        raise InvalidRequestError(f"top_k must be in 1..num_experts ({num_experts}), got {top_k}")
    reuse, hist, zipf_s = {"high": (0.8, history, 1.0), "low": (0.2, 2, 0.3), "uniform": (0.0, 1, 0.0)}[kind]
    rng = np.random.default_rng(seed)
    popularity = []
    for _ in range(num_layers):
        weights = np.empty(num_experts)
        weights[rng.permutation(num_experts)] = 1.0 / np.arange(1, num_experts + 1) ** zipf_s
        popularity.append(weights)
    recent = [deque(maxlen=hist) for _ in range(num_layers)]
    all_experts = np.arange(num_experts)
    steps: list[Step] = []
    for pos in range(num_prefill + num_tokens):
        by_layer: dict[int, list[int]] = {}
        for layer in range(num_layers):
            pool = np.unique(np.concatenate(list(recent[layer]))) if recent[layer] else all_experts[:0]
            n_reuse = min(int(rng.binomial(top_k, reuse)), len(pool))
            picked = rng.choice(pool, n_reuse, replace=False) if n_reuse else pool[:0]
            rest = np.setdiff1d(all_experts, picked, assume_unique=True)
            weights = popularity[layer][rest]
            fresh = rng.choice(rest, top_k - n_reuse, replace=False, p=weights / weights.sum())
            picked = np.concatenate([picked, fresh])
            recent[layer].append(picked)
            by_layer[layer] = [int(e) for e in picked]
        steps.append((0, pos, "prefill" if pos < num_prefill else "decode", by_layer))
    return RoutingTrace.from_steps(steps, num_experts)


def format_bench_table(results: Sequence[ReplayResult]) -> str:
    """Markdown: one row per policy, one column per cache fraction, decode miss rate in %."""
    fractions = sorted({r.cache_fraction for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    cell = {(r.policy, r.cache_fraction): r.miss_rate for r in results}
    head = "| policy | " + " | ".join(f"{f * 100:g}% cache" for f in fractions) + " |"
    rule = "|---|" + "---:|" * len(fractions)
    rows = [f"| {p} | " + " | ".join(f"{cell[p, f] * 100:.1f}%" for f in fractions) + " |" for p in policies]
    return "\n".join([head, rule, *rows])


def run_policy_bench(trace: str | Path | RoutingTrace,
                     cache_fractions: Sequence[float] | float = DEFAULT_CACHE_FRACTIONS,
                     policies: Sequence[str] | str = POLICY_NAMES, json: bool = False, *,
                     num_experts: int | None = None, num_layers: int | None = None,
                     b_p: float = DEFAULT_B_P, b_h: float = DEFAULT_B_H,
                     policy_opts: dict[str, dict] | None = None) -> str:
    """Decode miss rates of ``policies`` at each cache fraction: a markdown table, or JSON.
    ``trace`` is a JSON-lines file (see routing_trace.py) or an already loaded trace; a single
    fraction and a comma-separated policy string are accepted as they come from a CLI."""
    if isinstance(cache_fractions, (int, float)):
        cache_fractions = [float(cache_fractions)]
    if isinstance(policies, str):
        policies = [p.strip() for p in policies.split(",") if p.strip()]
    if not isinstance(trace, RoutingTrace):
        trace = read_routing_trace(trace, num_experts=num_experts)
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise InvalidRequestError(f"unknown split policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    policy_opts = policy_opts or {}
    results = [replay(trace, p, cache_fraction=f, num_layers=num_layers, num_experts=num_experts,
                      b_p=b_p, b_h=b_h, **policy_opts.get(p, {}))
               for p in policies for f in cache_fractions]
    if json:
        return _json.dumps({"num_layers": num_layers or trace.num_layers,
                            "num_experts": num_experts or trace.num_experts,
                            "b_p": b_p, "b_h": b_h, "results": [r.summary() for r in results]}, indent=2)
    return format_bench_table(results)
