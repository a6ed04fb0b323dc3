"""DaemonContext: what the servicers share (models, memory governor, serving state, counters)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from moed import __version__
from moed.engine.model_manager import ModelManager


@dataclass
class DaemonContext:
    manager: ModelManager
    pool: object | None = None  # engine.model_pool.ModelPool: loads on demand, keep-alive (None: explicit loads only)
    governor: object | None = None  # service.memory_governor.MemoryGovernor
    paused: bool = False
    stopping: bool = False
    last_error: str = ""
    cache_resizes: int = 0
    started_at: float = field(default_factory=time.time)
    shutdown_requested: threading.Event = field(default_factory=threading.Event)
    shutdown_cancel_inflight: bool = True
    version: str = __version__
    http_url: str = ""  # the HTTP API's base URL once it listens ("" when the daemon serves no HTTP)

    def state(self) -> str:
        if self.stopping:
            return "stopping"
        if self.manager.is_loading:
            return "loading"
        if self.paused:
            return "paused"
        if any(e.loop.num_active for e in self.manager.loaded()):
            return "generating"
        return "idle"

    def memory_figures(self) -> dict:
        import psutil

        figures = dict(self.governor.figures()) if self.governor is not None else {"source": "none"}
        figures.setdefault("vram_ours", sum(e.vram_bytes() for e in self.manager.loaded()))
        vm = psutil.virtual_memory()
        figures.update(host_total=vm.total, host_available=vm.available)
        return figures
