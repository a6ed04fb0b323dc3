"""The split policies (one small class each) and their registry ``make_policy`` / ``POLICY_NAMES``.

Every policy classifies a layer call's unique ids against the cache (hits = resident), touches
the hits, picks fills among the misses, takes slots for them with ``cache.choose_victims``
(hits protected, the policy's own ``eviction`` strategy ordering the victims, so ``lru-freq``
works even over a cache built with the default LRU) and admits them; the remaining misses run
on the CPU. Policies differ only in
how many misses they fill and which:

- ``adaptive`` (default): at most q = q*(m, B_P, B_H) fills, LRU victims, and admission
  control (``moed.cache.admission``): a miss takes an occupied slot only if its aged request
  frequency beats the LRU victim's (plus a bias); otherwise it runs on the CPU, which costs no
  copy. Three rules (recency-leaning, strict long-memory TinyLFU, plain LRU) duel through
  tag-only shadow caches and the real cache follows the one that has missed least lately.
  Deviation from the design's q*: "at least one fill per call" holds only while a slot is free
  or a miss passes the admission test; on a working set larger than the cache (a loop over
  all layers' experts) a forced fill per layer evicts exactly the entries needed next, and
  plain LRU then misses 100%.
- ``lru``: the design's original policy: q = q*(m, B_P, B_H), hottest misses first (most
  tokens, then lowest id), LRU victims, every call fills at least one miss.
- ``lru-freq``: ``lru`` over a segmented-LRU cache with a recency window
  (``LruFrequencyEviction``): experts reused recently are protected from one-off bursts.
- ``fill-all``: q = m, classic offloading: every miss is copied.
- ``cpu-all``: q = 0, every miss runs on the CPU; the cache never changes.
- ``fixed-share``: q = m - round(cpu_share * m), whatever the bandwidths (llama.cpp-like share).
- ``static``: llama.cpp-like placement fixed at load: an equal share of slots per layer (the
  first experts of each layer, or the most used ones of a frequency profile; ``layout=
  "layers"`` keeps whole last layers instead, like ``--n-cpu-moe``). A static expert
  is copied the first time it is requested (lazy load); nothing else is ever filled.
- ``hot-set``: KTransformers-like: expert usage is counted over each prefill; at the first
  decode step after it, the hot set becomes the most used experts (as many as there are
  slots). Hot experts are copied when first requested; misses outside the hot set run on the
  CPU, and the set does not change until the next prefill has come and gone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moed.cache.admission import DEFAULT_HALF_LIFE, DEFAULT_RULES, AdmissionDuel
from moed.cache.eviction import EvictionStrategy, LruEviction, LruFrequencyEviction
from moed.cache.expert_cache import ExpertCache
from moed.errors import InvalidRequestError, quoted
from moed.experts.split_policy import PHASES, SplitPlan, SplitPolicy, q_star, round_half_up


def _tuple(a: np.ndarray | Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in a)


class _BasePolicy:
    """Shared plan skeleton; subclasses implement ``_choose_fills``."""

    name = ""

    def __init__(self, eviction: EvictionStrategy | None = None) -> None:
        self.eviction: EvictionStrategy = eviction if eviction is not None else LruEviction()

    def plan(self, cache: ExpertCache, ids: Sequence[int], counts: Sequence[int], *,
             phase: str, b_p: float, b_h: float) -> SplitPlan:
        arr, cnt = _check_call(ids, counts, phase)
        slots = cache.lookup(arr)
        is_hit = slots >= 0
        hits, hit_slots = arr[is_hit], slots[is_hit]
        cache.touch(hits)
        misses, miss_counts = arr[~is_hit], cnt[~is_hit]
        by_heat = misses[np.lexsort((misses, -miss_counts))]  # most tokens first, ties by id
        fills, fill_slots = self._choose_fills(cache, by_heat, hits, phase=phase, b_p=b_p, b_h=b_h)
        evicted = cache.admit(fills, fill_slots)
        filled = set(_tuple(fills))
        cpu = tuple(int(i) for i in misses if int(i) not in filled)
        return SplitPlan(hits=_tuple(hits), hit_slots=_tuple(hit_slots), fills=_tuple(fills),
                         fill_slots=_tuple(fill_slots), cpu=cpu, evicted=tuple(evicted),
                         m=len(misses), q=len(fills))

    def _choose_fills(self, cache: ExpertCache, by_heat: np.ndarray, hits: np.ndarray, *,
                      phase: str, b_p: float, b_h: float) -> tuple[np.ndarray, list[int]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, eviction={self.eviction.name!r})"


def _check_call(ids: Sequence[int], counts: Sequence[int], phase: str) -> tuple[np.ndarray, np.ndarray]:
    if phase not in PHASES:
        raise ValueError(f"split policy phase must be one of {PHASES}, got {phase!r}")
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    cnt = np.asarray(counts, dtype=np.int64).reshape(-1)
    if len(cnt) != len(arr):
        raise ValueError(f"split policy: {len(arr)} ids but {len(cnt)} token counts")
    if len(np.unique(arr)) != len(arr):
        raise ValueError(f"split policy: ids must be de-duplicated per layer call, got {arr.tolist()}")
    return arr, cnt


# ---- quota policies: fill the q hottest misses into LRU (or SLRU) victims --------------------


class _QuotaPolicy(_BasePolicy):
    def _quota(self, m: int, *, phase: str, b_p: float, b_h: float) -> int:
        raise NotImplementedError

    def _choose_fills(self, cache, by_heat, hits, *, phase, b_p, b_h):
        q = self._quota(len(by_heat), phase=phase, b_p=b_p, b_h=b_h)
        victims = cache.choose_victims(q, protect=hits, eviction=self.eviction)
        return by_heat[: len(victims)], victims


class LruPolicy(_QuotaPolicy):
    """q = q*(m, B_P, B_H) hottest misses filled into LRU victims (the paper's policy, docs/design.md)."""

    name = "lru"

    def _quota(self, m, *, phase, b_p, b_h):
        return q_star(m, b_p, b_h)


class AdaptivePolicy(_BasePolicy):
    """At most q* fills into LRU victims, gated by a dueling admission filter (module doc)."""

    name = "adaptive"
    # misses the admission filter keeps out of the cache still count towards q*: the executor copies
    # them into scratch slots and runs them on the device without caching them (a bandwidth-balanced
    # split, with the cache protected from loops)
    transient_fills = True

    def __init__(self, rules: Sequence[tuple[float, float]] = DEFAULT_RULES,
                 half_life: float = DEFAULT_HALF_LIFE) -> None:
        super().__init__()
        self.admission = AdmissionDuel(rules, half_life)

    def plan(self, cache, ids, counts, *, phase, b_p, b_h):
        arr, cnt = _check_call(ids, counts, phase)
        self.admission.observe(cache, arr, cnt, lambda m: q_star(m, b_p, b_h))
        return super().plan(cache, ids, counts, phase=phase, b_p=b_p, b_h=b_h)

    def _choose_fills(self, cache, by_heat, hits, *, phase, b_p, b_h):
        return self.admission.rule.choose(
            cache, by_heat, hits, q_star(len(by_heat), b_p, b_h),
            evict_order=lambda k: cache.choose_victims(k, protect=hits, eviction=self.eviction))


class LruFreqPolicy(LruPolicy):
    """``lru`` whose cache evicts with segmented LRU (frequency-protected)."""

    name = "lru-freq"

    def __init__(self, min_uses: int = 2, protected_fraction: float = 0.8, window_factor: float = 4.0) -> None:
        super().__init__(LruFrequencyEviction(min_uses, protected_fraction, window_factor))


class FillAllPolicy(_QuotaPolicy):
    """Classic offloading: every miss is copied to the GPU."""

    name = "fill-all"

    def _quota(self, m, *, phase, b_p, b_h):
        return m


class CpuAllPolicy(_QuotaPolicy):
    """Every miss runs on the CPU; the cache is never filled."""

    name = "cpu-all"

    def _quota(self, m, *, phase, b_p, b_h):
        return 0


class FixedSharePolicy(_QuotaPolicy):
    """A fixed share of the misses on the CPU, whatever the bandwidths."""

    name = "fixed-share"

    def __init__(self, cpu_share: float = 0.5) -> None:
        if not isinstance(cpu_share, (int, float)) or not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"fixed-share cpu_share must be a number in [0, 1], got {cpu_share!r}")
        super().__init__()
        self.cpu_share = float(cpu_share)

    def _quota(self, m, *, phase, b_p, b_h):
        return max(m - round_half_up(self.cpu_share * m), 0)


# ---- set policies: only members of a chosen expert set are ever filled ------------------------


class _SetPolicy(_BasePolicy):
    """Fills every requested miss that belongs to the member set (lazy load); others go to CPU.
    Resident members are protected, so a member, once loaded, stays."""

    def _members(self, cache: ExpertCache, phase: str) -> np.ndarray | None:
        raise NotImplementedError

    def _choose_fills(self, cache, by_heat, hits, *, phase, b_p, b_h):
        members = self._members(cache, phase)
        if members is None or len(by_heat) == 0:
            return by_heat[:0], []
        wanted = by_heat[members[by_heat]]
        if len(wanted) == 0:
            return wanted, []
        resident = cache.slot_state().slot_ids
        resident = resident[resident >= 0]
        protect = np.concatenate([hits, resident[members[resident]]])
        victims = cache.choose_victims(len(wanted), protect=protect, eviction=self.eviction)
        return wanted[: len(victims)], victims


STATIC_LAYOUTS = ("share", "layers")


def static_placement(num_slots: int, num_experts: int, num_layers: int,
                     profile: Sequence[int] | np.ndarray | None = None, layout: str = "share") -> list[int]:
    """Flat ids of a llama.cpp-like static split of ``num_slots`` slots.

    ``share``: every layer gets an equal share (the first ``num_slots % num_layers`` layers one
    more); within a layer the most used experts of ``profile`` (counts per flat id), or experts
    0, 1, ... without one. ``layers``: whole layers from the last one down, as llama.cpp's
    ``--n-cpu-moe`` leaves the first layers' experts on the CPU (a partial layer takes its first
    or most used experts).
    """
    if num_experts < 1 or num_layers < 1:
        raise ValueError(f"static placement needs num_experts >= 1 and num_layers >= 1, "
                         f"got {num_experts} and {num_layers}")
    if layout not in STATIC_LAYOUTS:
        raise ValueError(f"static layout must be one of {STATIC_LAYOUTS}, got {layout!r}")
    prof = None
    if profile is not None:
        prof = np.asarray(profile, dtype=np.int64).reshape(-1)
        if len(prof) != num_experts * num_layers:
            raise ValueError(f"static profile has {len(prof)} counts, expected num_layers * num_experts "
                             f"= {num_layers * num_experts}")
    total = min(num_slots, num_experts * num_layers)
    if layout == "share":
        base, extra = divmod(total, num_layers)
        shares = [base + (1 if layer < extra else 0) for layer in range(num_layers)]
    else:
        full, part = divmod(total, num_experts)
        shares = [0] * num_layers
        for i in range(full):
            shares[num_layers - 1 - i] = num_experts
        if part:
            shares[num_layers - 1 - full] = part
    chosen: list[int] = []
    for layer, share in enumerate(shares):
        experts = np.arange(num_experts)
        if prof is not None:
            layer_counts = prof[layer * num_experts:(layer + 1) * num_experts]
            experts = np.lexsort((experts, -layer_counts))
        chosen.extend(layer * num_experts + int(e) for e in experts[:share])
    return chosen


class StaticPolicy(_SetPolicy):
    """llama.cpp-like: a fixed expert set decided at load (``prepare``), loaded lazily, never changed."""

    name = "static"

    def __init__(self, num_experts: int | None = None, num_layers: int | None = None,
                 profile: Sequence[int] | np.ndarray | None = None, layout: str = "share") -> None:
        if layout not in STATIC_LAYOUTS:
            raise ValueError(f"static layout must be one of {STATIC_LAYOUTS}, got {layout!r}")
        super().__init__()
        self.num_experts, self.num_layers, self.profile, self.layout = num_experts, num_layers, profile, layout
        self._mask: np.ndarray | None = None

    @property
    def static_ids(self) -> list[int]:
        return [] if self._mask is None else [int(i) for i in np.flatnonzero(self._mask)]

    def prepare(self, cache: ExpertCache, num_experts_per_layer: int, num_layers: int,
                profile: Sequence[int] | np.ndarray | None = None) -> list[int]:
        """Fix the static set for ``cache``'s size; returns its flat ids."""
        profile = profile if profile is not None else self.profile
        ids = static_placement(cache.num_slots, num_experts_per_layer, num_layers, profile, self.layout)
        self._mask = np.zeros(cache.num_ids, dtype=bool)
        self._mask[ids] = True
        return ids

    def _members(self, cache, phase):
        if self._mask is None:
            # not prepared: use the constructor's shape, else treat the id space as one layer
            num_layers = self.num_layers or 1
            self.prepare(cache, self.num_experts or cache.num_ids // num_layers, num_layers)
        return self._mask


class HotSetPolicy(_SetPolicy):
    """KTransformers-like: the hot set is re-chosen from prefill usage at the first decode step."""

    name = "hot-set"

    def __init__(self) -> None:
        super().__init__()
        self._prefill_counts: np.ndarray | None = None
        self._has_new_prefill = False
        self._mask: np.ndarray | None = None

    @property
    def hot_ids(self) -> list[int]:
        return [] if self._mask is None else [int(i) for i in np.flatnonzero(self._mask)]

    def plan(self, cache, ids, counts, *, phase, b_p, b_h):
        if self._prefill_counts is None or len(self._prefill_counts) != cache.num_ids:
            self._prefill_counts = np.zeros(cache.num_ids, dtype=np.int64)
        if phase == "prefill":
            arr, cnt = _check_call(ids, counts, phase)
            np.add.at(self._prefill_counts, arr, cnt)
            self._has_new_prefill = True
        elif phase == "decode" and self._has_new_prefill:
            self._choose_hot_set(cache.num_slots)
        return super().plan(cache, ids, counts, phase=phase, b_p=b_p, b_h=b_h)

    def _choose_hot_set(self, num_slots: int) -> None:
        counts = self._prefill_counts
        used = np.flatnonzero(counts > 0)
        order = used[np.lexsort((used, -counts[used]))]  # most used first, ties by id
        self._mask = np.zeros(len(counts), dtype=bool)
        self._mask[order[:num_slots]] = True
        counts[:] = 0
        self._has_new_prefill = False

    def _members(self, cache, phase):
        return self._mask


POLICIES: dict[str, type] = {
    "adaptive": AdaptivePolicy,
    "lru": LruPolicy,
    "fill-all": FillAllPolicy,
    "cpu-all": CpuAllPolicy,
    "static": StaticPolicy,
    "hot-set": HotSetPolicy,
    "fixed-share": FixedSharePolicy,
    "lru-freq": LruFreqPolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str, **opts: object) -> SplitPolicy:
    """A fresh policy called ``name`` (one of ``POLICY_NAMES``) with its options."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidRequestError(f"unknown split policy {quoted(name)}; choose one of {', '.join(POLICY_NAMES)}")
    try:
        return cls(**opts)
    except TypeError as exc:
        raise InvalidRequestError(f"split policy {quoted(name)} does not take options {sorted(opts)}: {exc}") from None
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
