"""HybridExecutor: per MoE layer and step, split routed experts between device cache and CPU.

For one layer call: de-duplicate the routed experts of the whole batch, let the split policy
classify hits H / misses M and choose the fill set F (q of them; q* = m * B_P / B_H for the
adaptive policy) and the CPU set C = M - F; start the CPU branch first on the persistent worker,
then queue the device branch in stream order (the copies of F into cache slots; H as one grouped
computation at once; F as another once its copies have landed), upload the CPU branch's rows and
merge the per-slot outputs on the device in fixed top-k order, so the result never depends on
placement. The device owns compute (``Device.enqueue`` / ``grouped_matmul``): there is no
per-device branch here.

Host syncs per layer call: one. With the model on the host it is the result's download; with the
model on the device (``model_on_device``) it is the download of the routing ids and hidden rows
the policy and the CPU branch need, and the result stays on the device.

Shapes: N routed tokens, A experts per token, D hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from moed.cache.expert_cache import ExpertCache
from moed.cache.host_bank import GGML_BANK, ExpertBank
from moed.devices.device import DeviceMemoryError, num_slots_of, slot_nbytes
from moed.experts import ggml_slots
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.cpu_pool import CpuWorkerPool
from moed.experts.device_ffn import copy_experts, run_grouped_experts, slot_layout_of
from moed.experts.engine_stats import EngineStats
from moed.experts.prefill_stream import STREAM_MIN_TOKENS, PrefillStream, stream_buffers
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
                 on_close: Callable[[], None] | None = None, model_on_device: bool = False,
                 prefill_buffers: int = 2) -> None:
        """``on_close`` releases what was set up for this executor outside it (the bank's pinning).

        ``model_on_device``: hidden states, routing ids and weights arrive as device tensors and the
        result stays there; otherwise they are host tensors and the result comes back to the host.
        ``prefill_buffers``: 2 streams prefill layers double-buffered, 1 loads each on demand
        (experts/prefill_stream.py); fewer are used when the pool cannot spare them.
        """
        stream_buffers(0, 1, prefill_buffers)  # refuses anything but 1 or 2
        self.prefill_buffers = prefill_buffers
        self._stream: PrefillStream | None = None
        self._layer_matrices: dict[int, dict[str, ggml_slots.SlotMatrix]] = {}
        self._layout: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None  # a ggml bank: its layers as slots hold them
        self.bank, self.device, self.policy, self.bandwidth = bank, device, policy, bandwidth
        self._on_close = on_close
        self.cpu_pool = cpu_pool or CpuWorkerPool()
        self.trace = trace
        self.model_on_device = model_on_device
        self._pending_copies: list = []  # copy handles not yet fed to the bandwidth model
        self._compute_seen = 0.0  # measuring devices (CUDA): their compute seconds booked so far
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
        if self._layout is None:
            self._layout = slot_layout_of(self.bank)
        return self._layout

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one cache slot (a ggml bank's: its widest layer's expert)."""
        return slot_nbytes(self._slot_layout())

    def _matrices(self, moe_layer: int) -> dict[str, ggml_slots.SlotMatrix] | None:
        """A ggml bank's layer as its slots hold it (types, shapes); None for the other banks."""
        if self.bank.dtype != GGML_BANK:
            return None
        found = self._layer_matrices.get(moe_layer)
        if found is None:
            found = self._layer_matrices[moe_layer] = ggml_slots.layer_matrices(self.bank, moe_layer)
        return found

    def _copy_in(self, slots: list[int], flat_ids: list[int]) -> list:
        """Queue the copies of the experts ``flat_ids`` into ``slots`` (one per layer for a ggml bank); the handles."""
        return copy_experts(self.device, self.slots, slots, self.bank, flat_ids)

    def _make_slot_bank(self) -> ExpertBank:
        return ExpertBank(num_moe_layers=1, num_experts=self.cache.num_slots + self.num_scratch, hidden_size=self.bank.hidden_size,
                          intermediate_size=self.bank.intermediate_size, dtype=self.bank.dtype,
                          activation=self.bank.activation, tensors=self.slots)

    def _refresh_cache_stats(self) -> None:
        self.stats.cache_slots = self.cache.num_slots + self.num_scratch
        self.stats.cache_bytes = self.stats.cache_slots * self.slot_bytes

    def _prepare_policy(self) -> None:
        """Placement-fixing policies (static) decide their set once the cache size is known."""
        prepare = getattr(self.policy, "prepare", None)
        if prepare is not None:
            prepare(self.cache, self.bank.num_experts, self.bank.num_moe_layers)

    def begin_step(self, phase: str, seq_ids: list, token_pos: list) -> None:
        """A step starts (a safe point): a long prefill streams whole layers, anything else ends the stream."""
        self.step = StepContext(phase, seq_ids, token_pos)
        store = self.cache.num_slots + self.num_scratch if self._stream is None else self._stream_store
        want = phase == "prefill" and len(token_pos) >= STREAM_MIN_TOKENS
        buffers = stream_buffers(store, self.bank.num_experts, self.prefill_buffers) if want else 0
        if self._stream is not None and self._stream.num_buffers != buffers:
            self._end_stream()
        if buffers and self._stream is None:
            self._begin_stream(buffers)
        if self._stream is not None and self._stream.double:
            # layer 0's load starts before its routing is known
            self._stream.pending[0] = self._load_layer(0)

    def _begin_stream(self, buffers: int) -> None:
        """Take ``buffers`` layers at the top of the slot store from the cache (it keeps its best entries)."""
        store = self.cache.num_slots + self.num_scratch
        base = store - buffers * self.bank.num_experts
        plan = self.cache.resize(min(self.cache.num_slots, base))
        self.device.move_slots(self.slots, list(plan.moves))
        self._stream_store = store
        self._stream = PrefillStream(buffers, base, self.bank.num_experts, self.bank.num_moe_layers)

    def _end_stream(self) -> None:
        """Give the buffers back to the cache (as free slots); loads in flight land in them harmlessly."""
        if self._stream is None:
            return
        self.cache.resize(self._stream_store - self.num_scratch)  # growing keeps every entry in place
        self._stream = None

    def _load_layer(self, moe_layer: int, experts: list[int] | None = None):
        """Queue the copy of ``experts`` (default: all) of ``moe_layer`` into its buffer; the copy handle."""
        st = self._stream
        experts = list(range(self.bank.num_experts)) if experts is None else experts
        base = self.bank.flat_id(moe_layer, 0)
        [handle] = self._copy_in([st.slot(moe_layer, e) for e in experts], [base + e for e in experts])
        self._pending_copies.append(handle)
        self.stats.streamed_bytes += handle.nbytes
        return handle

    def resize(self, num_slots: int) -> None:
        """Change the cache size (call between steps: a safe point). Never changes results.

        The old slots are freed before the new ones are allocated, and the entries the cache keeps
        are copied back from the host bank (always complete): the device never holds old and new
        storage at once, so a shrink forced by another app's allocation (little VRAM free) and a
        grow into just the room that came back both fit. The refill is queued on the copy stream;
        device work queued after it waits for it (no host wait)."""
        self._end_stream()
        use = bool(getattr(self.policy, "transient_fills", False)) and num_slots > 0
        self.num_scratch = min(MAX_SCRATCH_SLOTS, max(1, num_slots // 4)) if use else 0
        self.use_transients = use
        plan = self.cache.resize(num_slots - self.num_scratch)
        if self.slots and num_slots_of(self.slots) == num_slots and all(o == n for o, n in plan.moves):
            kept = []  # same storage, every kept entry where it was: nothing to move
        else:
            kept = [(new, int(self.cache.slot_state().slot_ids[new])) for _, new in plan.moves]
            if self.slots:
                self.device.free_slots(self.slots)
            try:
                self.slots = self.device.alloc_slots(num_slots, self._slot_layout()) if num_slots else {}
            except DeviceMemoryError:
                # no room even for the new size alone: run on without a cache (every miss on the CPU,
                # slower, never wrong) and say so; a later budget can grow it again
                self.cache.resize(0)
                self.num_scratch, self.use_transients, self.slots = 0, False, {}
                self.slot_bank = self._make_slot_bank()
                self._prepare_policy()
                self._refresh_cache_stats()
                raise
        for handle in self._copy_in([slot for slot, _ in kept], [flat_id for _, flat_id in kept]) if kept else []:
            self.device.wait_copy(handle)
            self._pending_copies.append(handle)
            self.stats.refill_bytes += handle.nbytes
        self.slot_bank = self._make_slot_bank()
        self._prepare_policy()
        self._refresh_cache_stats()

    def close(self) -> None:
        """Stop the CPU worker, free the device slots and release the bank's pinning; safe to call twice."""
        self.cpu_pool.close()
        if self.slots:
            self.device.free_slots(self.slots)  # empties the dict; CUDA also returns its cached VRAM
        if self.trace is not None:
            self.trace.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:  # once, even if close() is called again
            on_close()

    # -- the step -----------------------------------------------------------------------------
    def run(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
            topk_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer: one host sync (see the module docstring), whatever the placement.

        If anything fails (a kernel, the CPU branch), the device work this call queued is run out
        and dropped before the error propagates, so the next call (another request's) starts clean.
        """
        try:
            if self._stream is not None:
                return self._run_streamed(moe_layer, hidden, topk_ids, topk_weights)
            return self._run_split(moe_layer, hidden, topk_ids, topk_weights)
        except BaseException:
            try:
                self.device.flush()
            except Exception:  # the queued work failed too: it is dropped all the same
                pass
            raise

    def _run_split(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> torch.Tensor:
        dev = self.device
        num_tokens, top_k = topk_ids.shape
        width = hidden.shape[1]
        if self.model_on_device:
            # the layer's one host sync: the routing ids the policy needs and the rows the CPU branch reads
            topk_ids_host, hidden_host = dev.to_host(topk_ids, hidden)
        else:
            topk_ids_host, hidden_host = topk_ids, hidden
        base = moe_layer * self.bank.num_experts
        flat = (topk_ids_host.reshape(-1) + base).numpy()  # [N * A]
        ids, inverse, counts = np.unique(flat, return_inverse=True, return_counts=True)
        if self.trace is not None:
            self._record(moe_layer, topk_ids_host)
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

        # CPU branch first: it gets a head start on DRAM
        cpu_job = self.cpu_pool.submit(lambda: self._run_cpu(cpu_ids, tokens_of, hidden_host, top_k)) if cpu_ids else None

        # device branch, in stream order: the fill set's copies start, hits compute at once, fills
        # once their copies have landed; nothing here makes the host wait
        copies = list(zip(plan.fills, plan.fill_slots)) + transients
        if copies:  # one layer: one copy
            [handle] = self._copy_in([slot for _, slot in copies], [flat_id for flat_id, _ in copies])
            self._pending_copies.append(handle)
        x_dev = dev.to_device(hidden)
        per_slot = torch.empty((num_tokens * top_k, width), dtype=torch.float32, device=dev.compute_device)
        charged: list[float] = []
        matrices = self._matrices(moe_layer)
        self._enqueue_group(x_dev, per_slot, list(zip(plan.hits, plan.hit_slots)), tokens_of, charged, matrices)
        if copies:
            dev.wait_copy(handle)
            self._enqueue_group(x_dev, per_slot, copies, tokens_of, charged, matrices)
        cpu_s = self._collect_cpu(cpu_job, cpu_ids, tokens_of, per_slot)

        out = self._merge(per_slot, topk_weights, hidden.dtype)
        copy_s = self._observe_copies()
        self._account(plan, len(transients), cpu_s, copy_s, self._device_seconds(charged))
        return out

    def _run_streamed(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        """A prefill layer from its buffer: every routed expert on the device, one host sync."""
        dev, st = self.device, self._stream
        num_tokens, top_k = topk_ids.shape
        width = hidden.shape[1]
        topk_ids_host = dev.to_host(topk_ids)[0] if self.model_on_device else topk_ids
        base = self.bank.flat_id(moe_layer, 0)
        flat = (topk_ids_host.reshape(-1) + base).numpy()
        ids, inverse, _ = np.unique(flat, return_inverse=True, return_counts=True)
        if self.trace is not None:
            self._record(moe_layer, topk_ids_host)
        tokens_of = self._tokens_by_expert(ids, inverse, top_k)
        if st.double:
            handle = st.pending.pop(moe_layer, None) or self._load_layer(moe_layer)
            if moe_layer + 1 < st.num_layers:  # the next layer's load overlaps this layer's compute
                st.pending[moe_layer + 1] = self._load_layer(moe_layer + 1)
        else:  # on demand: the routed experts only, now that the routing is known
            handle = self._load_layer(moe_layer, [int(i) - base for i in ids])
        dev.wait_copy(handle)
        x_dev = dev.to_device(hidden)
        per_slot = torch.empty((num_tokens * top_k, width), dtype=torch.float32, device=dev.compute_device)
        charged: list[float] = []
        work = [(int(flat_id), st.slot(moe_layer, int(flat_id) - base)) for flat_id in ids]
        self._enqueue_group(x_dev, per_slot, work, tokens_of, charged, self._matrices(moe_layer))
        out = self._merge(per_slot, topk_weights, hidden.dtype)
        copy_s = self._observe_copies()
        self.stats.streamed_layers += 1
        self.stats.copy_seconds += copy_s
        self.stats.device_compute_seconds += self._device_seconds(charged)
        return out

    def _merge(self, per_slot: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Queue the merge on the device in fixed top-k order (never depends on where an expert ran);
        the result on the host after the layer's one host sync, or left on the device with the model."""
        dev = self.device
        num_tokens, top_k = topk_weights.shape
        weights = dev.to_device(topk_weights)
        out = torch.empty((num_tokens, per_slot.shape[1]), dtype=dtype, device=dev.compute_device)
        dev.enqueue(lambda: out.copy_(merge_expert_outputs(per_slot.view(num_tokens, top_k, -1), weights)))
        if self.model_on_device:
            dev.flush()
            return out
        return dev.to_host(out)[0]

    def _enqueue_group(self, x_dev: torch.Tensor, per_slot: torch.Tensor, work: list[tuple[int, int]],
                       tokens_of: dict, charged: list[float],
                       matrices: dict[str, ggml_slots.SlotMatrix] | None = None) -> None:
        """Queue the experts of ``work`` ((flat id, slot) pairs, one layer's) as one grouped computation;
        ``matrices``: that layer's, for a ggml bank."""
        if not work:
            return
        dev = self.device
        rows = torch.cat([tokens_of[flat_id][1] for flat_id, _ in work])  # token rows, grouped by expert
        picks = torch.cat([tokens_of[flat_id][0] for flat_id, _ in work])  # their places in [N * A]
        offsets = [0]
        for flat_id, _ in work:
            offsets.append(offsets[-1] + len(tokens_of[flat_id][1]))
        slot_ids = [slot for _, slot in work]
        rows_dev, picks_dev = dev.to_device(rows), dev.to_device(picks)
        per_expert = sum(m.nbytes for m in matrices.values()) if matrices else self.bank.bytes_per_expert()
        nbytes = len(work) * per_expert
        d, inter = self.bank.hidden_size, self.bank.intermediate_size
        flops = 6.0 * d * inter * offsets[-1]  # gate_up (D x 2I) and down (I x D), 2 FLOP per weight per row

        def compute() -> None:
            x = x_dev.index_select(0, rows_dev).float()
            y = run_grouped_experts(dev, self.slot_bank, x, slot_ids, offsets, matrices)
            per_slot.index_copy_(0, picks_dev, y)
            charged.append(dev.charge_compute(nbytes, flops))

        dev.enqueue(compute)

    def _collect_cpu(self, cpu_job, cpu_ids, tokens_of, per_slot: torch.Tensor) -> float:
        """Wait for the CPU branch (a host thread, not the device) and queue its rows' upload into ``per_slot``."""
        if cpu_job is None:
            return 0.0
        results, cpu_s = cpu_job.result()
        picks = torch.cat([tokens_of[flat_id][0] for flat_id in cpu_ids])
        if isinstance(results, torch.Tensor):  # one native call: per-slot rows [N * A, D]
            rows = results.index_select(0, picks)
        else:  # (flat id, [T, D]) in cpu_ids order
            rows = torch.cat([out for _, out in results])
        dev = self.device
        rows_dev, picks_dev = dev.to_device(rows.float()), dev.to_device(picks)
        dev.enqueue(lambda: per_slot.index_copy_(0, picks_dev, rows_dev))
        self.bandwidth.observe_cpu(len(cpu_ids) * self.bank.bytes_per_expert(), cpu_s)
        return cpu_s

    def _device_seconds(self, charged: list[float]) -> float:
        """Device compute time of this layer: what the timing model charged (emulated), or the event-measured
        time a measuring device (CUDA) has booked since the last look (it lags: kernels finish later)."""
        if not getattr(self.device, "measured_compute", False):
            return sum(charged)
        total = self.device.stats().compute_seconds
        seconds, self._compute_seen = total - self._compute_seen, total
        return seconds

    def _observe_copies(self) -> float:
        """Feed the copies that have landed to the bandwidth model; their link seconds."""
        seconds, still = 0.0, []
        for handle in self._pending_copies:
            if handle.done():
                self.bandwidth.observe_copy(handle.nbytes, handle.seconds)
                seconds += handle.seconds
            else:
                still.append(handle)
        self._pending_copies = still
        return seconds

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
