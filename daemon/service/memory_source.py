"""Sources of GPU memory readings: NVML, an in-process simulation, a JSON file, or no GPU at all."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReading:
    """One look at a GPU's memory, in bytes. `total == 0` means there is no GPU to govern."""

    total: int
    free: int
    used_by_others: int  # other processes, plus anything the driver holds that is not ours
    used_by_us: int
    source: str  # nvml | simulated | none

    @property
    def has_gpu(self) -> bool:
        return self.total > 0


class MemorySource(Protocol):
    """Anything the governor can poll. `ours_hint` is what the daemon knows it holds (set_ours)."""

    def read(self, ours_hint: int = 0) -> MemoryReading: ...


NO_GPU = MemoryReading(total=0, free=0, used_by_others=0, used_by_us=0, source="none")


class NoGpuSource:
    """A machine without NVML (or without an NVIDIA GPU): nothing to govern, total 0."""

    def read(self, ours_hint: int = 0) -> MemoryReading:
        return NO_GPU

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return "NoGpuSource()"


def _simulated_reading(total: int, other_apps: int, ours_hint: int) -> MemoryReading:
    others = min(max(0, other_apps), total)
    ours = max(0, ours_hint)
    return MemoryReading(total=total, free=max(0, total - others - ours), used_by_others=others,
                         used_by_us=ours, source="simulated")


class SimulatedSource:
    """A GPU of `total` bytes where other apps hold `other_apps`; tests move that figure in-process."""

    def __init__(self, total: int, other_apps: int = 0) -> None:
        if total < 0 or other_apps < 0:
            raise ValueError(f"SimulatedSource: sizes must be >= 0, got total={total}, other_apps={other_apps}")
        self._total = int(total)
        self._other_apps = int(other_apps)
        self._lock = threading.Lock()

    def set_other_apps(self, num_bytes: int) -> None:
        """Pretend other applications now use `num_bytes` of VRAM (thread-safe)."""
        if num_bytes < 0:
            raise ValueError(f"other apps' use must be >= 0, got {num_bytes}")
        with self._lock:
            self._other_apps = int(num_bytes)

    def read(self, ours_hint: int = 0) -> MemoryReading:
        with self._lock:
            total, others = self._total, self._other_apps
        return _simulated_reading(total, others, ours_hint)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"SimulatedSource(total={self._total}, other_apps={self._other_apps})"


class FileSource:
    """A simulated GPU described by a JSON file `{"total": int, "other_apps": int}`, re-read on every poll.

    A test rewrites the file to make "another app" grab or release VRAM inside a real daemon
    process. A missing, partial or malformed file keeps the last good reading (or no GPU until
    the first good one), so a writer caught mid-write never makes the budget jump.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._last: tuple[int, int] | None = None  # (total, other_apps) from the last good read
        self._warned = False

    def _load(self) -> tuple[int, int] | None:
        try:
            data = json.loads(self.path.read_text())
            total, others = data["total"], data.get("other_apps", 0)
            if not (isinstance(total, int) and isinstance(others, int)) or isinstance(total, bool) \
                    or isinstance(others, bool) or total < 0 or others < 0:
                raise ValueError(f"total and other_apps must be non-negative integers, got {data!r}")
            return total, others
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if not self._warned:  # once per bad spell, not once per poll
                log.warning("GPU memory file %s unreadable (%s); keeping the last good reading", self.path, exc)
                self._warned = True
            return None

    def read(self, ours_hint: int = 0) -> MemoryReading:
        loaded = self._load()
        if loaded is not None:
            self._last, self._warned = loaded, False
        if self._last is None:
            return NO_GPU
        return _simulated_reading(self._last[0], self._last[1], ours_hint)

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"FileSource({str(self.path)!r})"


class NvmlSource:
    """Readings of one NVIDIA GPU through NVML (pynvml, from the nvidia-ml-py package).

    Other apps' use is total - free - ours, where ours is NVML's per-process figure for our pids
    when NVML can attribute it (a pid of ours is listed with a known usedGpuMemory), else the
    daemon's own figure (`ours_hint`, from set_ours) -- in containers NVML lists host pids, and on
    some platforms usedGpuMemory is unknown. Memory the driver reserves thus counts as "others",
    which errs on the safe side; the sum NVML lists for other pids is a floor.
    """

    def __init__(self, device_index: int = 0, our_pids: tuple[int, ...] | None = None) -> None:
        import pynvml

        self._nvml = pynvml
        self.device_index = device_index
        self.our_pids = frozenset(our_pids if our_pids is not None else (os.getpid(),))
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            raise RuntimeError(f"NVML is not usable on this machine ({exc}); use NoGpuSource") from exc
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception as exc:
            pynvml.nvmlShutdown()
            raise RuntimeError(f"NVML has no GPU with index {device_index} ({exc})") from exc
        self._closed = False

    @classmethod
    def available(cls, device_index: int = 0) -> bool:
        """True when NVML loads and GPU `device_index` exists. Never raises."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            return False
        try:
            return device_index < pynvml.nvmlDeviceGetCount()
        except Exception:
            return False
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass

    def _process_use(self) -> tuple[int | None, int]:
        """(bytes NVML attributes to our pids, or None if it can't; bytes it attributes to others)."""
        nvml = self._nvml
        ours: int | None = None
        others = 0
        for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                processes = query(self._handle)
            except Exception:  # NoPermission / NotSupported: no per-process view
                continue
            for proc in processes:
                used = getattr(proc, "usedGpuMemory", None)
                if used is None:  # NVML says "not available" (e.g. Windows WDDM)
                    continue
                if proc.pid in self.our_pids:
                    ours = (ours or 0) + int(used)
                else:
                    others += int(used)
        return ours, others

    def read(self, ours_hint: int = 0) -> MemoryReading:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        total, free = int(info.total), int(info.free)
        ours_listed, others_listed = self._process_use()
        ours = ours_listed if ours_listed is not None else max(0, ours_hint)
        others = max(others_listed, total - free - ours, 0)
        return MemoryReading(total=total, free=free, used_by_others=min(others, total),
                             used_by_us=ours, source="nvml")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"NvmlSource(device_index={self.device_index})"


def default_memory_source(device_index: int = 0, gpu_memory_file: Path | None = None) -> MemorySource:
    """The source a daemon should use: a FileSource when `gpu_memory_file` is given
    (config.gpu_memory_file(), $MOED_GPU_MEMORY_FILE), else NVML when it works, else no GPU."""
    if gpu_memory_file is not None:
        return FileSource(gpu_memory_file)
    if NvmlSource.available(device_index):
        try:
            return NvmlSource(device_index)
        except Exception as exc:  # lost between the probe and the open: run without a GPU budget
            log.warning("NVML became unusable (%s); running without GPU memory readings", exc)
    return NoGpuSource()
