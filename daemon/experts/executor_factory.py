"""Build the expert executor for a loaded bank: CPU-only, or hybrid over an emulated / CUDA device."""

from __future__ import annotations

import logging

from pathlib import Path

from moed.cache.host_bank import ExpertBank
from moed.devices.device import slot_nbytes
from moed.config import EngineConfig
from moed.devices.select import select_device as _select_device
from moed.errors import InvalidRequestError
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.calibration import load_profile
from moed.experts.cpu_executor import CpuExecutor
from moed.experts.cpu_layout import interleave_for_cpu
from moed.experts.cpu_pool import CpuWorkerPool
from moed.experts.device_ffn import slot_layout_of
from moed.experts.engine_stats import EngineStats
from moed.experts.hybrid_executor import HybridExecutor
from moed.experts.policies import make_policy
from moed.experts.routing_trace import RoutingTraceWriter

DEFAULT_B_H = 20e9  # bytes/s: a starting point only; real steps correct it within a few layers
DEFAULT_B_P = 16e9

log = logging.getLogger(__name__)


def select_device(name: str, **opts):
    """The device layer's choice, with its refusals (no CUDA, unknown name) as request errors."""
    try:
        return _select_device(name, **opts)
    except (ValueError, RuntimeError) as exc:
        raise InvalidRequestError(str(exc)) from None


def cache_slots_for(bank: ExpertBank, cache_fraction: float) -> int:
    """Slots that fit a byte budget of ``cache_fraction`` of the expert pool (a slot's bytes: a ggml bank's
    slots are as wide as its widest layer's experts)."""
    budget = int(cache_fraction * bank.nbytes())
    return min(bank.num_slots, budget // max(1, slot_nbytes(slot_layout_of(bank))))


def initial_bandwidth(kind: str, bank: ExpertBank, cfg: EngineConfig) -> BandwidthModel:
    """From this machine's calibration profile (`moed bench bw`) if any, else defaults; adapts from there."""
    profile = load_profile(kind, bank)
    if kind == "emulated":
        # the link pace is configured; the CPU side is this machine's, measured or default
        b_h = profile.b_h if profile else DEFAULT_B_H
        return BandwidthModel.from_alone(cfg.emulated_b_p, b_h, adapt=cfg.adapt_bandwidth)
    if profile is not None and profile.b_h_concurrent > 0:
        return BandwidthModel(profile.b_p_concurrent, profile.b_h_concurrent, adapt=cfg.adapt_bandwidth)
    return BandwidthModel.from_alone(DEFAULT_B_P, DEFAULT_B_H, adapt=cfg.adapt_bandwidth)


def build_executor(bank: ExpertBank, cfg: EngineConfig, *, trace_out: str | Path | None = None):
    device = select_device(cfg.device, b_p=cfg.emulated_b_p, b_dev=cfg.emulated_b_dev)
    stats = EngineStats(device=device.kind, policy=cfg.policy)
    release = None
    if device.kind != "cpu":
        report = device.pin_host(bank.storage())
        stats.pinned_bytes, stats.pageable_bytes, stats.pin_note = (
            report.pinned_bytes, report.pageable_bytes, report.reason)
        if report.pinned_bytes == 0 and bank.nbytes() > 0:
            # nothing could be registered for DMA: the CPU-only backend is slower but never fails
            device = select_device("cpu")
        else:
            pinned_on = device
            release = lambda: pinned_on.unpin_host(report)  # noqa: E731 - on close: the bank's pages stop being locked
    else:
        stats.pageable_bytes = bank.nbytes()
    if device.kind == "cpu" and trace_out:
        # record routing on the CPU backend too: the hybrid executor with no cache, all on the CPU
        return HybridExecutor(bank, device, num_slots=0, policy=make_policy("cpu-all"),
                              bandwidth=BandwidthModel.from_alone(DEFAULT_B_P, DEFAULT_B_H, adapt=False),
                              cpu_pool=CpuWorkerPool(cfg.cpu_kernel_threads),
                              trace=RoutingTraceWriter(trace_out), stats=stats)
    if device.kind == "cpu":
        interleave_for_cpu(bank)  # only the CPU reads the bank: its faster layouts (a device's slots read GGUF rows)
        executor = CpuExecutor(bank)
        executor.stats.pinned_bytes, executor.stats.pageable_bytes = stats.pinned_bytes, stats.pageable_bytes
        executor.stats.pin_note = stats.pin_note
        return executor
    policy = make_policy(cfg.policy, **dict(cfg.policy_options))
    trace = RoutingTraceWriter(trace_out) if trace_out else None
    return HybridExecutor(bank, device, num_slots=cache_slots_for(bank, cfg.cache_fraction), policy=policy,
                          bandwidth=initial_bandwidth(device.kind, bank, cfg),
                          cpu_pool=CpuWorkerPool(cfg.cpu_kernel_threads), trace=trace, stats=stats,
                          on_close=release, prefill_buffers=cfg.prefill_buffers)
