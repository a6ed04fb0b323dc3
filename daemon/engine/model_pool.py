"""ModelPool: models loaded when a request names them, unloaded when idle past their keep-alive or when another
model needs the room (least recently used first), as Ollama does.

* ``acquire(name)`` returns the loaded model of that name, or loads it (catalog names: ``moed.catalog``); requests
  for a model being loaded wait for that one load, up to ``load_wait_s``, then get ServiceUnavailableError with a
  Retry-After (the load goes on).
* Room: before a load, while more than ``max_loaded - 1`` models are loaded, or the load does not fit the memory
  budget (the host RAM psutil reports, or ``memory_budget`` bytes for all models), the least recently used idle
  model is unloaded; a busy model is never unloaded, so a load that finds none idle fails with the memory error.
* Keep-alive: a model loaded on demand stays ``keep_alive_s`` seconds after its last request (None: forever;
  0: unloaded as soon as it is idle); a request's ``keep_alive`` replaces it for that model. Models loaded
  explicitly (``moed load``, ``moed serve --model``, the tray) stay until unloaded unless a request sets one.
* The reaper thread checks every ``tick_s``; a model counts as used while it runs or queues requests.

Control code only: no tensors; the manager does the loading and the memory release.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as WaitTimeout
from dataclasses import dataclass, field

from moed.engine.model_manager import LoadedEntry, LoadOptions, ModelManager
from moed.errors import InsufficientMemoryError, InvalidRequestError, ServiceUnavailableError, quoted

log = logging.getLogger("moed.pool")

FOREVER = None
UNSET = object()  # a request that says nothing about keep-alive


@dataclass(frozen=True)
class PoolConfig:
    keep_alive_s: float | None = 300.0  # of models loaded on demand (Ollama's default: 5 minutes)
    max_loaded: int = 0  # at most this many models at once (0: as many as memory holds)
    load_wait_s: float = 300.0  # a request waits this long for its model's load, then 503 + Retry-After
    memory_budget: int | None = None  # bytes all loaded models may take together (None: the host's free RAM)
    tick_s: float = 0.25
    options: LoadOptions = field(default_factory=LoadOptions)  # how models are loaded on demand


HOLD_S = 5.0  # a model just handed to a request is not unloaded before the request reaches its queue


@dataclass
class _Life:
    keep_alive_s: float | None
    last_used: float
    hold_until: float = 0.0


class ModelPool:
    def __init__(self, manager: ModelManager, config: PoolConfig = PoolConfig(), *, clock=time.monotonic,
                 on_loaded=None) -> None:
        """``on_loaded(entry)``: called on the loading thread after each load (the daemon shares out the VRAM)."""
        self.manager = manager
        self._on_loaded = on_loaded
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._lives: dict[str, _Life] = {}
        self._loads: dict[str, Future] = {}  # name -> the load in flight
        self._load_started: dict[str, float] = {}
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self._host_ram = manager.host_ram_available
        manager.host_ram_available = self.available_bytes

    # -- memory ---------------------------------------------------------------------------------
    @staticmethod
    def used_bytes(entry: LoadedEntry) -> int:
        """Host RAM a loaded model holds, as its load planned it (weights, KV pool, states, step activations):
        the same sum a new load is checked with."""
        return entry.planned_bytes or entry.host_bytes()

    def available_bytes(self) -> int:
        """What a new load may take: the host's free RAM, within the pool's budget for all models."""
        if self._host_ram is not None:
            free = self._host_ram()
        else:
            import psutil

            free = psutil.virtual_memory().available
        if self.config.memory_budget is not None:
            used = sum(self.used_bytes(e) for e in self.manager.loaded())
            free = min(free, max(self.config.memory_budget - used, 0))
        return free

    # -- requests ---------------------------------------------------------------------------------
    def acquire(self, name: str, *, keep_alive=UNSET, options: LoadOptions | None = None,
                wait_s: float | None = None) -> LoadedEntry:
        """The loaded model ``name``, loaded first if need be (see the module docstring)."""
        entry = self._loaded(name)
        if entry is None:
            future = self.start_load(name, options)
            try:
                entry = future.result(timeout=self.config.load_wait_s if wait_s is None else wait_s)
            except WaitTimeout:
                waited = self._clock() - self._load_started.get(name, self._clock())
                raise ServiceUnavailableError(
                    f"model {quoted(name)} is still loading ({waited:.0f} s so far); retry in a few seconds "
                    "(`moed ps` shows the load)", retry_after=5) from None
        self.touch(entry.name, keep_alive)
        return entry

    def touch(self, name: str, keep_alive=UNSET, *, hold: bool = True) -> None:
        """A request uses ``name`` now; ``keep_alive`` (seconds, None = forever, UNSET = unchanged) counts from its
        end. ``hold``: the request is yet to be submitted (the model stays for it); False: nothing will run (a
        load-only request), so keep_alive 0 unloads at once."""
        with self._lock:
            life = self._lives.get(name)
            if life is None:
                life = self._lives[name] = _Life(FOREVER, self._clock())
            life.last_used = self._clock()
            life.hold_until = self._clock() + HOLD_S if hold else 0.0
            if keep_alive is not UNSET:
                life.keep_alive_s = keep_alive
        if not hold:
            self._reap()

    def expires_in(self, name: str) -> float | None:
        """Seconds until ``name`` unloads when it stays idle (None: it stays)."""
        with self._lock:
            life = self._lives.get(name)
            if life is None or life.keep_alive_s is None:
                return None
            return max(0.0, life.last_used + life.keep_alive_s - self._clock())

    def loading(self) -> dict[str, float]:
        """Models being loaded on demand -> seconds since their load was asked for (making room included)."""
        with self._lock:
            return {n: self._clock() - self._load_started.get(n, self._clock()) for n in self._loads}

    def _loaded(self, name: str) -> LoadedEntry | None:
        for entry in self.manager.loaded():
            if entry.name == name:
                return entry
        return None

    def start_load(self, name: str, options: LoadOptions | None = None) -> Future:
        """The load of ``name`` (a Future of its LoadedEntry): the one in flight, a new one, or a done one when the
        model is loaded under its catalog name. InvalidRequestError at once for a name no source has."""
        found = self.manager.find(name)  # unknown names fail here, before any thread
        canonical = name if found.source == "path" else found.name
        loaded = self._loaded(canonical)
        if loaded is not None:
            done: Future = Future()
            done.set_result(loaded)
            return done
        with self._lock:
            future = self._loads.get(canonical)
            if future is None:
                future = Future()
                self._loads[canonical] = future
                self._load_started[canonical] = self._clock()
                threading.Thread(target=self._load, args=(name, canonical, options or self.config.options, future),
                                 name=f"moed-load-{canonical[:40]}", daemon=True).start()
        return future

    def _load(self, name: str, canonical: str, options: LoadOptions, future: Future) -> None:
        try:
            entry = self._load_with_room(name, canonical, options)
            with self._lock:
                self._lives[entry.name] = _Life(self.config.keep_alive_s, self._clock())
            if self._on_loaded is not None:
                self._on_loaded(entry)
            future.set_result(entry)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting request
            future.set_exception(exc)
        finally:
            with self._lock:
                self._loads.pop(canonical, None)
                self._load_started.pop(canonical, None)

    def _load_with_room(self, name: str, canonical: str, options: LoadOptions) -> LoadedEntry:
        if self.config.max_loaded:
            while len(self.manager.loaded()) >= self.config.max_loaded:
                if not self._unload_lru(f"room for {canonical} (at most {self.config.max_loaded} models)"):
                    raise ServiceUnavailableError(
                        f"cannot load {quoted(canonical)}: {self.config.max_loaded} models are loaded and all are "
                        "busy; retry when one is idle", retry_after=5)
        while True:
            try:
                return self.manager.load(name, options, name=canonical)
            except InsufficientMemoryError:
                if not self._unload_lru(f"memory for {canonical}"):
                    raise

    def _unload_lru(self, why: str) -> bool:
        """Unload the least recently used idle model; False when every loaded model is busy (or none is)."""
        idle = [e for e in self.manager.loaded() if not e.loop.num_active and not e.loop.num_queued]
        if not idle:
            return False
        with self._lock:
            victim = min(idle, key=lambda e: self._lives.get(e.name, _Life(None, 0.0)).last_used)
        log.info("unloading %s (least recently used) to make %s", victim.name, why)
        self._forget(victim.name)
        self.manager.unload(victim.name)
        return True

    def _forget(self, name: str) -> None:
        with self._lock:
            self._lives.pop(name, None)

    # -- keep-alive -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._run, name="moed-keep-alive", daemon=True)
            self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.config.tick_s):
            try:
                self._reap()
            except Exception:  # noqa: BLE001 - the reaper outlives any one failure
                log.exception("keep-alive check failed")

    def _reap(self) -> None:
        now = self._clock()
        for entry in self.manager.loaded():
            with self._lock:
                life = self._lives.get(entry.name)
                if life is None:
                    continue
                if entry.loop.num_active or entry.loop.num_queued:
                    life.last_used = now  # in use: the keep-alive counts from its last request's end
                    life.hold_until = 0.0  # its request arrived
                    continue
                expired = (life.keep_alive_s is not None and now - life.last_used >= life.keep_alive_s
                           and now >= life.hold_until)
            if expired:
                log.info("unloading %s: idle for its keep-alive", entry.name)
                self._forget(entry.name)
                self.manager.unload(entry.name)

    def forget_explicit(self, name: str) -> None:
        """An explicit load (``moed load``): it stays until unloaded; an earlier keep-alive no longer applies."""
        with self._lock:
            self._lives[name] = _Life(FOREVER, self._clock())


def parse_keep_alive(value) -> float | None:
    """Ollama's keep_alive: seconds as a number, a duration string ("5m", "1h30m", "10s", "0"), or a negative value
    for forever (None). InvalidRequestError for anything else."""
    if value is None:
        raise InvalidRequestError("keep_alive is null; give a duration like \"5m\", seconds, 0 or -1")
    if isinstance(value, bool):
        raise InvalidRequestError(f"keep_alive {quoted(value)}: give a duration like \"5m\", seconds, 0 or -1")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _duration(text, value)
    if seconds != seconds or seconds in (float("inf"),):
        raise InvalidRequestError(f"keep_alive {quoted(value)} is not a duration")
    return None if seconds < 0 else seconds


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _duration(text: str, original) -> float:
    """Go's time.ParseDuration forms ("1h30m", "-1m", "2.5s")."""
    import re

    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise InvalidRequestError(f"keep_alive {quoted(original)}: give a duration like \"5m\", \"1h30m\", "
                                  "seconds, 0 or -1")
    return sign * sum(float(n) * _UNITS[u] for n, u in parts)
