"""HybridExecutor: per MoE layer and step, split routed experts between device cache and CPU.

For one layer call: de-duplicate the routed experts of the whole batch, let the split policy
classify hits H / misses M and choose the fill set F (q of them; q* = m * B_P / B_H for the
adaptive policy) and the CPU set C = M - F; start the CPU branch first on the persistent worker,
then run the device branch (copy F into cache slots, compute H and F); merge the per-slot outputs
in a fixed order so the result never depends on placement.

Shapes: N routed tokens, A experts per token, D hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from moed.cache.expert_cache import ExpertCache
from moed.cache.host_bank import ExpertBank
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.cpu_pool import CpuWorkerPool
from moed.experts.device_ffn import run_slot_expert
from moed.experts.engine_stats import EngineStats
from moed.experts.executor import merge_expert_outputs
from moed.experts.expert_ffn import run_expert
from moed.experts.routed_ffn import run_routed, uses_native
from moed.experts.routing_trace import RoutingTraceWriter
from moed.experts.split_policy import SplitPolicy, q_star

MAX_SCRATCH_SLOTS = 8  # uncached device slots for q* fills the admission filter declines


@dataclass
class StepContext:
    """What the model tells the executor about the current forward step."""

    phase: str = "decode"  # prefill | decode
    seq_ids: list = field(default_factory=list)  # per routed token (for traces)
    token_pos: list = field(default_factory=list)  # per routed token


class HybridExecutor:
    def __init__(self, bank: ExpertBank, device, *, num_slots: int, policy: SplitPolicy,
                 bandwidth: BandwidthModel, cpu_pool: CpuWorkerPool | None = None,
                 trace: RoutingTraceWriter | None = None, stats: EngineStats | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        """``on_close`` releases what was set up for this executor outside it (the bank's pinning)."""
        self.bank, self.device, self.policy, self.bandwidth = bank, device, policy, bandwidth
        self._on_close = on_close
        self.cpu_pool = cpu_pool or CpuWorkerPool()
        self.trace = trace
        self.on_cuda = getattr(device, "kind", "") == "cuda"
        self.use_transients = bool(getattr(policy, "transient_fills", False)) and num_slots > 0
        self.num_scratch = min(MAX_SCRATCH_SLOTS, max(1, num_slots // 4)) if self.use_transients else 0
        num_cached = num_slots - self.num_scratch  # scratch slots come out of the same byte budget
        self.cache = ExpertCache(bank.num_slots, num_cached, eviction=getattr(policy, "eviction", None))
        self.slots = device.alloc_slots(num_slots, self._slot_layout()) if num_slots else {}
        self._prepare_policy()
        self.slot_bank = self._make_slot_bank()
        self.step = StepContext()
        self.stats = stats or EngineStats()
        self.stats.device, self.stats.policy = getattr(device, "kind", "?"), policy.name
        self._refresh_cache_stats()

    # -- configuration ------------------------------------------------------------------------
    def _slot_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(t.shape[1:]), t.dtype) for name, t in self.bank.tensors.items()}

    def _make_slot_bank(self) -> ExpertBank:
        return ExpertBank(num_moe_layers=1, num_experts=self.cache.num_slots + self.num_scratch, hidden_size=self.bank.hidden_size,
                          intermediate_size=self.bank.intermediate_size, dtype=self.bank.dtype,
                          activation=self.bank.activation, tensors=self.slots)

    def _refresh_cache_stats(self) -> None:
        self.stats.cache_slots = self.cache.num_slots + self.num_scratch
        self.stats.cache_bytes = self.stats.cache_slots * self.bank.bytes_per_expert()

    def _prepare_policy(self) -> None:
        """Placement-fixing policies (static) decide their set once the cache size is known."""
        prepare = getattr(self.policy, "prepare", None)
        if prepare is not None:
            prepare(self.cache, self.bank.num_experts, self.bank.num_moe_layers)

    def begin_step(self, phase: str, seq_ids: list, token_pos: list) -> None:
        self.step = StepContext(phase, seq_ids, token_pos)

    def resize(self, num_slots: int) -> None:
        """Change the cache size (call between steps: a safe point). Never changes results."""
        use = bool(getattr(self.policy, "transient_fills", False)) and num_slots > 0
        self.num_scratch = min(MAX_SCRATCH_SLOTS, max(1, num_slots // 4)) if use else 0
        self.use_transients = use
        plan = self.cache.resize(num_slots - self.num_scratch)
        self.slots = self.device.resize_slots(self.slots, num_slots, list(plan.moves)) if (
            num_slots or self.slots) else {}
        if num_slots and not self.slots:
            self.slots = self.device.alloc_slots(num_slots, self._slot_layout())
        self.slot_bank = self._make_slot_bank()
        self._prepare_policy()
        self._refresh_cache_stats()

    def close(self) -> None:
        self.cpu_pool.close()
        if self.trace is not None:
            self.trace.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:  # once, even if close() is called again
            on_close()

    # -- the step -----------------------------------------------------------------------------
    def run(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        base = moe_layer * self.bank.num_experts
        flat = (topk_ids.reshape(-1) + base).numpy()  # [N * A]
        ids, inverse, counts = np.unique(flat, return_inverse=True, return_counts=True)
        if self.trace is not None:
            self._record(moe_layer, topk_ids)
        self.cache.advance()
        b_p, b_h = self.bandwidth.current()
        plan = self.policy.plan(self.cache, ids.tolist(), counts.tolist(), phase=self.step.phase, b_p=b_p, b_h=b_h)
        tokens_of = self._tokens_by_expert(ids, inverse, top_k)
        cpu_ids, transients = list(plan.cpu), []
        if self.use_transients and cpu_ids:
            # q* says how many misses the link should take; fill the rest of that quota without caching
            room = min(q_star(plan.m, b_p, b_h) - len(plan.fills), self.num_scratch, len(cpu_ids))
            if room > 0:
                hottest = sorted(cpu_ids, key=lambda i: (-len(tokens_of[i][1]), i))[:room]
                transients = [(flat_id, self.cache.num_slots + k) for k, flat_id in enumerate(hottest)]
                cpu_ids = [i for i in cpu_ids if i not in set(hottest)]
        per_slot = hidden.new_empty(num_tokens, top_k, hidden.shape[1])  # [N, A, D]
        flat_out = per_slot.view(-1, hidden.shape[1])

        # CPU branch first: it gets a head start on DRAM
        cpu_job = self.cpu_pool.submit(lambda: self._run_cpu(cpu_ids, tokens_of, hidden, top_k)) if cpu_ids else None

        # device branch: copy the fill set into its slots (concurrently with the CPU branch)
        copy_s = 0.0
        copies = list(zip(plan.fills, plan.fill_slots)) + transients
        if copies:
            handle = self.device.copy_rows_async(self.slots, [slot for _, slot in copies], self.bank.tensors,
                                                 [flat_id for flat_id, _ in copies])
            handle.wait()
            copy_s = handle.seconds
            self.bandwidth.observe_copy(handle.nbytes, handle.seconds)
        device_work = list(zip(plan.hits, plan.hit_slots)) + copies
        cpu_s = 0.0
        if not self.on_cuda:
            # emulated device: its compute runs on these same CPU cores, so let the CPU branch finish
            # first (its time stays honest) and charge device compute by the timing model instead
            cpu_s = self._collect_cpu(cpu_job, cpu_ids, tokens_of, flat_out)
        started = time.perf_counter()
        charged = 0.0
        for flat_id, slot in device_work:
            picks, tokens = tokens_of[flat_id]
            x = hidden[tokens].contiguous()
            if self.on_cuda:
                flat_out[picks] = run_slot_expert(self.slot_bank, slot, x.to(self._device_of()), on_cuda=True).cpu()
            else:
                flat_out[picks] = run_slot_expert(self.slot_bank, slot, x, on_cuda=False)
            charged += self.device.charge_compute(self.bank.bytes_per_expert())
        device_s = time.perf_counter() - started if self.on_cuda else charged
        if self.on_cuda:
            cpu_s = self._collect_cpu(cpu_job, cpu_ids, tokens_of, flat_out)
        self._account(plan, len(transients), cpu_s, copy_s, device_s)
        return merge_expert_outputs(per_slot, topk_weights)

    def _collect_cpu(self, cpu_job, cpu_ids, tokens_of, flat_out) -> float:
        if cpu_job is None:
            return 0.0
        results, cpu_s = cpu_job.result()
        if isinstance(results, torch.Tensor):  # one native call: per-slot rows [N * A, D]
            for flat_id in cpu_ids:
                picks = tokens_of[flat_id][0]
                flat_out[picks] = results[picks]
            results = ()
        for flat_id, out in results:
            flat_out[tokens_of[flat_id][0]] = out
        self.bandwidth.observe_cpu(len(cpu_ids) * self.bank.bytes_per_expert(), cpu_s)
        return cpu_s

    def _run_cpu(self, cpu_ids, tokens_of, hidden, top_k: int) -> tuple[list | torch.Tensor, float]:
        started = time.perf_counter()
        num_tokens = hidden.shape[0]
        if uses_native(self.bank, num_tokens):  # the set C in one native call, by flat id
            flat = torch.full((num_tokens * top_k,), -1, dtype=torch.int32)
            for flat_id in cpu_ids:
                flat[tokens_of[flat_id][0]] = flat_id
            per_slot, _ = run_routed(self.bank, hidden, flat.view(num_tokens, top_k))
            return per_slot.view(num_tokens * top_k, -1), time.perf_counter() - started
        results = []
        for flat_id in cpu_ids:
            _, tokens = tokens_of[flat_id]
            results.append((flat_id, run_expert(self.bank, flat_id, hidden[tokens].contiguous())))
        return results, time.perf_counter() - started

    @staticmethod
    def _tokens_by_expert(ids: np.ndarray, inverse: np.ndarray, top_k: int) -> dict[int, tuple]:
        """flat id -> (positions in the flattened [N * A], token rows)."""
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(ids) + 1))
        out = {}
        for i, flat_id in enumerate(ids.tolist()):
            picks = torch.from_numpy(order[bounds[i] : bounds[i + 1]].astype(np.int64))
            out[flat_id] = (picks, picks // top_k)
        return out

    def _device_of(self):
        return next(iter(self.slots.values())).device

    def _account(self, plan, num_transient: int, cpu_s: float, copy_s: float, device_s: float) -> None:
        s = self.stats
        s.hits += len(plan.hits)
        s.misses += len(plan.fills) + len(plan.cpu)
        s.fills += len(plan.fills)
        s.transient_fills += num_transient
        s.cpu_experts += len(plan.cpu) - num_transient
        s.last_q, s.last_m = plan.q + num_transient, plan.m
        s.b_p, s.b_h = self.bandwidth.current()
        s.cpu_seconds += cpu_s
        s.copy_seconds += copy_s
        s.device_compute_seconds += device_s
        s.modelled_seconds += max(cpu_s, copy_s + device_s)

    def _record(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        seqs, positions = self.step.seq_ids, self.step.token_pos
        for row, experts in enumerate(topk_ids.tolist()):
            seq = seqs[row] if row < len(seqs) else 0
            pos = positions[row] if row < len(positions) else row
            self.trace.write(seq, pos, moe_layer, experts, self.step.phase)
