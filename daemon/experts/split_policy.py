"""The fill/CPU split of one MoE layer call: q* from measured bandwidths, the plan type, the policy seam.

docs/design.md, "Decode: splitting the misses": with B_P the measured PCIe expert-transfer
bandwidth and B_H the measured host-side expert-execution bandwidth, q* = m * B_P / B_H of the
m misses are copied to the GPU (fills) and the rest run on the CPU. The concrete policies
(adaptive, fill-all, static, ...) and their registry ``make_policy`` live in ``policies.py``,
which imports this module (never the other way round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from moed.cache.eviction import EvictionStrategy
    from moed.cache.expert_cache import ExpertCache

PHASES = ("prefill", "decode")


def round_half_up(x: float) -> int:
    """Round to the nearest integer, halves up (Python's round() goes to even)."""
    return int(math.floor(x + 0.5))


def check_bandwidths(b_p: float, b_h: float) -> None:
    for name, value in (("B_P (PCIe expert-transfer bandwidth)", b_p),
                        ("B_H (host expert-execution bandwidth)", b_h)):
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number of GB/s, got {value!r}; "
                             "measure it on this machine (moed bench) before planning a split")


def q_star(m: int, b_p: float, b_h: float) -> int:
    """Fills out of ``m`` misses: 0 if m == 0, else round(m * B_P / B_H) clamped to [1, m].

    At least one fill keeps the cache warming; B_H <= B_P means the CPU cannot beat the copy,
    so every miss is filled.
    """
    check_bandwidths(b_p, b_h)
    if m < 0:
        raise ValueError(f"number of misses must be >= 0, got {m}")
    if m == 0:
        return 0
    if b_h <= b_p:
        return m
    return min(max(round_half_up(m * b_p / b_h), 1), m)


def q_split(m: int, b_p_concurrent: float, b_h_concurrent: float) -> int:
    """q from the rates each branch reaches *while the other runs*: q = m * B_P' / (B_P' + B_H').

    With the paper's linear model (B_H' = B_H - B_P) this is exactly q*; measured concurrently it
    also holds where that model breaks (a compute-bound CPU branch that DMA does not slow down).
    """
    return q_star(m, b_p_concurrent, b_p_concurrent + b_h_concurrent)


@dataclass(frozen=True)
class SplitPlan:
    """Where each routed expert of one layer call runs.

    ``hits`` (resident, run from ``hit_slots``), ``fills`` (copied into ``fill_slots`` this call,
    then run on the GPU) and ``cpu`` (run in place from the host bank) partition the call's
    unique ids. ``evicted`` are the ids whose slots the fills took. ``m`` = number of misses
    (fills + cpu), ``q`` = number of fills.
    """

    hits: tuple[int, ...]
    hit_slots: tuple[int, ...]
    fills: tuple[int, ...]
    fill_slots: tuple[int, ...]
    cpu: tuple[int, ...]
    evicted: tuple[int, ...]
    m: int
    q: int

    def check(self, ids: Sequence[int]) -> None:
        """Raise ValueError unless this plan partitions ``ids`` consistently (tests, debugging)."""
        parts = self.hits + self.fills + self.cpu
        if sorted(parts) != sorted(int(i) for i in ids) or len(set(parts)) != len(parts):
            raise ValueError(f"split plan does not partition the ids: hits={self.hits} "
                             f"fills={self.fills} cpu={self.cpu} ids={list(ids)}")
        if len(self.hit_slots) != len(self.hits) or len(self.fill_slots) != len(self.fills):
            raise ValueError("split plan: slot lists do not match their id lists")
        if len(set(self.fill_slots)) != len(self.fill_slots) or set(self.fill_slots) & set(self.hit_slots):
            raise ValueError(f"split plan: fill slots {self.fill_slots} repeat or hold a hit "
                             f"(hit slots {self.hit_slots})")
        if self.m != len(self.fills) + len(self.cpu) or self.q != len(self.fills):
            raise ValueError(f"split plan: m={self.m}, q={self.q} disagree with the id lists")


class SplitPolicy(Protocol):
    """Decides, per layer call, which misses to fill and which run on the CPU.

    ``ids`` are the unique flat ids routed in this layer for this step (whole batch
    de-duplicated), ``counts`` the tokens routed to each. The policy touches the hits and
    admits the fills into ``cache`` (the cache's clock is the caller's: ``advance()`` once per
    layer call). ``eviction`` orders this policy's victims; build the cache with it too
    (``ExpertCache(..., eviction=policy.eviction)``) so that ``resize`` keeps the same entries the
    policy values. A policy with a ``prepare(cache, num_experts_per_layer, num_layers)`` method
    (``static``) wants it called once after the cache is built.
    """

    name: str
    eviction: "EvictionStrategy"

    def plan(self, cache: "ExpertCache", ids: Sequence[int], counts: Sequence[int], *,
             phase: str, b_p: float, b_h: float) -> SplitPlan: ...
