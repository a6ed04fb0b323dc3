"""Calibration: measure B_P (expert copies to the device) and B_H (CPU expert execution) on this
machine with the model's real expert shape and dtype, alone and both at once, and keep a profile
per machine + model shape + dtype.
"""

from __future__ import annotations

import hashlib
import json
import platform
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moed.cache.host_bank import ExpertBank
from moed.config import cache_dir
from moed.experts.device_ffn import copy_experts, slot_layout_of
from moed.experts.expert_ffn import run_expert
from moed.experts.routed_ffn import run_routed

_EXPERTS_PER_CALL = 8  # a top-8 decode layer


@dataclass(frozen=True)
class CalibrationProfile:
    machine: str
    device: str
    expert_shape: str  # "DxI dtype"
    b_p: float  # bytes/s, copies alone
    b_h: float  # bytes/s, CPU experts alone
    b_p_concurrent: float  # both branches at once
    b_h_concurrent: float
    bytes_per_expert: int
    measured_at: float

    @property
    def q_ratio(self) -> float:
        """q*/m = B_P / B_H (clamped to 1)."""
        return min(1.0, self.b_p / self.b_h)


def machine_id() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{socket.gethostname()} / {cpu}"


def profile_path(device_name: str, bank: ExpertBank) -> Path:
    key = f"{machine_id()}|{device_name}|{bank.hidden_size}x{bank.intermediate_size}|{bank.dtype}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{digest}.json"


def load_profile(device_name: str, bank: ExpertBank) -> CalibrationProfile | None:
    path = profile_path(device_name, bank)
    try:
        return CalibrationProfile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # absent or unreadable: the engine starts from defaults and adapts


def save_profile(profile: CalibrationProfile, bank: ExpertBank) -> Path:
    path = profile_path(profile.device, bank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=2))
    tmp.replace(path)
    return path


def _cpu_pass(bank: ExpertBank, ids: list[int], stop: threading.Event | None = None) -> tuple[int, float]:
    # as the engine calls the CPU branch: one token, several experts per MoE call
    x = torch.randn(1, bank.hidden_size)
    started = time.perf_counter()
    done = 0
    for start in range(0, len(ids), _EXPERTS_PER_CALL):
        if stop is not None and stop.is_set():
            break
        chunk = ids[start : start + _EXPERTS_PER_CALL]
        for layer in sorted({i // bank.num_experts for i in chunk}):  # a call runs one layer (a ggml bank's rule)
            part = [i for i in chunk if i // bank.num_experts == layer]
            run_routed(bank, x, torch.tensor([part], dtype=torch.int32))
        done += len(chunk)
    return done * bank.bytes_per_expert(), time.perf_counter() - started


def _copy_pass(device, slots: dict, bank: ExpertBank, ids: list[int], num_slots: int) -> tuple[int, float]:
    started = time.perf_counter()
    nbytes = 0
    for start in range(0, len(ids), num_slots):
        chunk = ids[start : start + num_slots]
        for handle in copy_experts(device, slots, list(range(len(chunk))), bank, chunk):
            handle.wait()
            nbytes += handle.nbytes
    return nbytes, time.perf_counter() - started


def calibrate(device, bank: ExpertBank, *, seconds: float = 1.0, num_slots: int = 8) -> CalibrationProfile:
    """Measure both bandwidths alone, then together; ``seconds`` is roughly the time per phase.

    Copies come from ``bank`` as it is: pin it first (``device.pin_host``), as serving does, or
    B_P is the pageable rate. The slots it measures with are freed before it returns.
    """
    per_expert = bank.bytes_per_expert()
    run_expert(bank, 0, torch.randn(1, bank.hidden_size))  # compile the kernel outside timing
    # enough distinct experts per pass that caches cannot serve them
    count = max(num_slots, min(bank.num_slots, int(2 * 2**30 // max(per_expert, 1)) or 1))
    ids = [i % bank.num_slots for i in range(count)]
    slots = device.alloc_slots(num_slots, slot_layout_of(bank))
    try:
        return _measure(device, bank, ids, slots, seconds, num_slots)
    finally:
        device.free_slots(slots)


def _measure(device, bank: ExpertBank, ids: list[int], slots: dict, seconds: float, num_slots: int) -> CalibrationProfile:
    per_expert = bank.bytes_per_expert()

    def timed(fn, *args):
        total_bytes, total_s = 0, 0.0
        while total_s < seconds:
            nbytes, secs = fn(*args)
            total_bytes, total_s = total_bytes + nbytes, total_s + secs
        return total_bytes / total_s

    b_h = timed(_cpu_pass, bank, ids)
    b_p = timed(_copy_pass, device, slots, bank, ids, num_slots)
    # both at once: the CPU branch runs while copies stream
    stop = threading.Event()
    cpu_result: list[tuple[int, float]] = []
    worker = threading.Thread(target=lambda: cpu_result.append(_cpu_pass(bank, ids * 50, stop)))
    worker.start()
    copy_bytes, copy_s = 0, 0.0
    while copy_s < seconds:
        nbytes, secs = _copy_pass(device, slots, bank, ids, num_slots)
        copy_bytes, copy_s = copy_bytes + nbytes, copy_s + secs
    stop.set()
    worker.join()
    cpu_bytes, cpu_s = cpu_result[0]
    return CalibrationProfile(
        machine=machine_id(), device=getattr(device, "kind", "?"),
        expert_shape=f"{bank.hidden_size}x{bank.intermediate_size} {bank.dtype}",
        b_p=b_p, b_h=b_h, b_p_concurrent=copy_bytes / copy_s, b_h_concurrent=cpu_bytes / cpu_s if cpu_s else 0.0,
        bytes_per_expert=per_expert, measured_at=time.time())
