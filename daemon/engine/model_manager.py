"""ModelManager: the daemon's loaded models (runtime + engine loop each), models on disk, safe-point changes.

Loads and unloads never stop other models: each loaded model has its own engine loop; a cache
resize is applied by that model's loop between two steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from moed.catalog.catalog import Catalog, CatalogRoots
from moed.catalog.entry import CatalogEntry, disk_bytes
from moed.catalog.own_models import model_name_of
from moed.config import EngineConfig
from moed.engine.engine_loop import EngineLoop
from moed.engine.runtime import ModelRuntime, open_runtime
from moed.engine.memory_release import release_freed_memory
from moed.engine.runtime_hook import apply_runtime_hook
from moed.engine.load_plan import check_load_fits, plan_load
from moed.errors import InvalidRequestError, ModelExistsError, ModelFormatError, quoted
from moed.layers.packed_linear import weight_nbytes

ProgressFn = Callable[[str, int, int], None]  # (stage, done bytes, total bytes)
MAX_NAME_CHARS = 200


@dataclass(frozen=True)
class LoadOptions:
    device: str = "auto"
    policy: str = "adaptive"
    policy_options: tuple[tuple[str, float], ...] = ()
    cache_fraction: float = 0.25
    context_length: int | None = None
    experts_dtype: str | None = None
    verify: bool = False
    max_batch: int = 8
    max_queue: int = 64
    emulated_b_p: float = 16e9
    weights_dtype: str = "auto"  # non-expert weights: the checkpoint's dtype, or "fp32"
    prefix_cache: bool = True  # reuse the K/V of earlier requests' common prefixes
    kv_tokens: int | None = None  # the KV pool's size in tokens (None: engine/kv_manager.kv_pool_tokens)
    checkpoint_bytes: int | None = None  # hybrid models' state checkpoints (None: load_plan.DEFAULT_CHECKPOINT_BYTES)
    kv_type: str | None = None  # the KV pool's type: "bf16", "f32" or "q8_0" (None: the weights' own, bf16 or f32)


@dataclass
class LoadedEntry:
    name: str
    path: Path
    runtime: ModelRuntime
    loop: EngineLoop
    options: LoadOptions
    loaded_at: float = field(default_factory=time.time)
    source: str = "path"  # where its files are (moed.catalog.entry.SOURCES)
    planned_bytes: int = 0  # the host RAM its load was planned to take (weights, KV pool, states, activations)
    found: CatalogEntry | None = None  # what the catalog said of it (Ollama's default parameters and system)

    @property
    def stats(self):
        return self.runtime.executor.stats

    def host_bytes(self) -> int:
        """Host RAM of this model: its expert bank, and its non-expert weights unless they live on the device."""
        if self.runtime.loaded is None:  # a model without checkpoint weights (a test stand-in)
            return 0
        bank = self.runtime.loaded.bank.nbytes()
        if self.runtime.model.device is not None:
            return bank  # weights (and KV) are device memory, counted by vram_bytes
        weights = sum(weight_nbytes(t) for t in self.runtime.loaded.weights.values())  # tensors or PackedLinear
        return weights + bank

    def vram_bytes(self) -> int:
        """Device memory of this model: its expert cache and, when the model runs there, weights + KV."""
        if self.stats.device not in ("cuda", "emulated"):
            return 0
        return self.stats.cache_bytes + self.stats.model_device_bytes


dir_bytes = disk_bytes  # bytes on disk of a model directory or a GGUF (all its parts)


class ModelManager:
    def __init__(self, search_dirs: list[Path], *, host_ram_available: Callable[[], int] | None = None,
                 catalog: Catalog | None = None) -> None:
        """``search_dirs``: moed's own model folders; ``catalog``: where else models are found by name (default:
        only those folders); ``host_ram_available`` overrides psutil's reading (tests simulate a small machine)."""
        self.search_dirs = search_dirs
        self.catalog = catalog or Catalog(CatalogRoots(moed=tuple(search_dirs)))
        self.host_ram_available = host_ram_available
        self._models: dict[str, LoadedEntry] = {}
        self._lock = threading.Lock()
        self._loads_done = threading.Condition(self._lock)
        self._loading = 0
        self._reserved: set[str] = set()  # names of loads in flight
        self._progress: dict[str, tuple[float, float]] = {}  # load in flight -> (started, fraction read)
        self._closing = False  # close() was called: no new loads; loads in flight stop at their next progress
        self.last_used: str | None = None

    # -- discovery ------------------------------------------------------------------------------
    def discover(self) -> list[Path]:
        """The models in moed's own folders."""
        return [e.path for e in self.catalog.own()]

    def find(self, model: str) -> CatalogEntry:
        """The model a name or path means (``moed.catalog``); InvalidRequestError naming where it looked."""
        if not isinstance(model, str) or not model or "\x00" in model or len(model) > 4096:
            raise InvalidRequestError(f"model {quoted(model)}: give a model directory or the name of one")
        entry = self.catalog.resolve(model)
        if entry is None:
            roots = self.catalog.roots
            where = [*(str(d) for d in roots.moed)]
            where += [f"Ollama's store ({d})" for d in roots.ollama if d.is_dir()]
            if roots.huggingface is not None and roots.huggingface.is_dir():
                where.append(f"the Hugging Face cache ({roots.huggingface})")
            where += [f"LM Studio's folder ({d})" for d in roots.lmstudio if d.is_dir()]
            raise InvalidRequestError(f"model {quoted(model)} not found: not a directory or GGUF file, and no model "
                                      f"of that name in {', '.join(where) or '(no model folder)'}; `moed models` "
                                      "lists the names, `moed pull` fetches one from the Hugging Face Hub")
        return entry

    def resolve(self, model: str) -> Path:
        return self.find(model).path

    # -- load / unload ---------------------------------------------------------------------------
    @property
    def is_loading(self) -> bool:
        return self._loading > 0

    def loading(self) -> dict[str, tuple[float, float]]:
        """Loads in flight (explicit and on demand) -> (seconds since they started, fraction of the weights read)."""
        now = time.monotonic()
        with self._lock:
            return {name: (now - started, fraction) for name, (started, fraction) in self._progress.items()}

    def load(self, model: str, options: LoadOptions, *, name: str = "", progress: ProgressFn | None = None) -> LoadedEntry:
        """Load a model and start its engine loop; everything that can be checked before reading the
        weights is (options, name, host RAM for weights plus KV cache), and a load that fails later
        leaves nothing behind."""
        found = self.find(model)
        path = found.path
        given = Path(model).expanduser()
        # the name the user gave (a symlinked directory keeps its own name), else the catalog's
        name = name or (model_name_of(given) if found.source == "path" and given.name else found.name)
        if len(name) > MAX_NAME_CHARS or any(not c.isprintable() for c in name):
            raise InvalidRequestError(f"model name {quoted(name)} must be at most {MAX_NAME_CHARS} printable characters")
        available = self.host_ram_available() if self.host_ram_available else None
        plan = plan_load(path, options, available_bytes=available)  # reads config.json / the FTW index only
        with self._lock:
            if self._closing:
                raise InvalidRequestError("the daemon is shutting down; no new models are loaded")
            if name in self._models or name in self._reserved:
                what = "is already loaded" if name in self._models else "is being loaded"
                raise ModelExistsError(f"a model named {quoted(name)} {what}; unload it first or pick another name")
            self._reserved.add(name)  # a second load of this name is refused until this one ends
            self._progress[name] = (time.monotonic(), 0.0)
            self._loading += 1
        runtime = loop = None
        try:
            available = self.host_ram_available() if self.host_ram_available else None
            check_load_fits(plan, available_bytes=available, what=f"model {quoted(name)}")
            engine = EngineConfig(device=options.device, cache_fraction=options.cache_fraction, policy=options.policy,
                                  policy_options=options.policy_options, emulated_b_p=options.emulated_b_p)

            def report(done: int, total: int) -> None:  # on the loading thread, between reads
                if self._closing:
                    raise InvalidRequestError(f"loading {quoted(name)} stopped: the daemon is shutting down")
                if total:
                    with self._lock:
                        if name in self._progress:
                            self._progress[name] = (self._progress[name][0], done / total)
                if progress:
                    progress("reading", done, total)

            runtime = open_runtime(path, experts_dtype=options.experts_dtype, verify=options.verify,
                                   progress=report, engine=engine, weights_dtype=options.weights_dtype)
            if options.kv_type is not None:
                runtime.model.kv_dtype = plan.kv_dtype
            runtime = apply_runtime_hook(runtime, name)
            with self._lock:
                self._progress[name] = (self._progress[name][0], 1.0)  # every weight is read
            if progress:
                progress("building", 1, 1)
            if runtime.tokenizer is None:
                raise ModelFormatError(f"{path}: no tokenizer.json; the daemon serves text and needs one")
            loop = EngineLoop(runtime, name=name, max_batch=options.max_batch, max_queue=options.max_queue,
                              context_length=plan.context_length, prefix_cache=options.prefix_cache,
                              kv_tokens=plan.kv_tokens, checkpoint_bytes=plan.checkpoint_bytes)
            entry = LoadedEntry(name, path, runtime, loop, options, source=found.source, planned_bytes=plan.total_bytes,
                                found=found)
            with self._lock:
                if self._closing:
                    raise InvalidRequestError(f"loading {quoted(name)} stopped: the daemon is shutting down")
                loop.start()
                self._models[name] = entry
            return entry
        except BaseException:
            # nothing half-loaded stays behind: the KV cache, the bank and the executor's threads go
            if loop is not None:
                loop.stop(cancel_inflight=True)
            if runtime is not None:
                runtime.close()
            runtime = loop = None
            release_freed_memory()  # a failed load gives back what it had read
            raise
        finally:
            with self._lock:
                self._reserved.discard(name)
                self._progress.pop(name, None)
                self._loading -= 1
                self._loads_done.notify_all()

    def unload(self, name: str) -> bool:
        with self._lock:
            entry = self._models.pop(name, None)
        if entry is None:
            return False
        entry.loop.stop(cancel_inflight=True)
        entry.runtime.close()
        del entry
        release_freed_memory()
        return True

    def close(self, *, cancel_inflight: bool = True, load_timeout: float = 60.0) -> None:
        """Shut down: refuse new loads, stop loads in flight (at their next read) and wait for
        them, then unload every model. A loading thread must not outlive the daemon: the process
        would exit with native threads still running inside it."""
        with self._lock:
            self._closing = True
            self._loads_done.wait_for(lambda: self._loading == 0, timeout=load_timeout)
        self.unload_all(cancel_inflight=cancel_inflight)

    def unload_all(self, *, cancel_inflight: bool = True) -> None:
        with self._lock:
            entries = list(self._models.values())
            self._models.clear()
        while entries:
            entry = entries.pop()
            entry.loop.stop(cancel_inflight=cancel_inflight)
            entry.runtime.close()
            del entry
            release_freed_memory()

    # -- lookup -------------------------------------------------------------------------------------
    def get(self, name: str = "") -> LoadedEntry:
        with self._lock:
            if name:
                entry = self._models.get(name)
                if entry is None:
                    loaded = ", ".join(self._models) or "none"
                    raise InvalidRequestError(f"model {quoted(name)} is not loaded (loaded: {loaded}); load it with `moed load`")
            elif len(self._models) == 1:
                entry = next(iter(self._models.values()))
            elif not self._models:
                raise InvalidRequestError("no model is loaded; load one with `moed load MODEL`")
            else:
                raise InvalidRequestError(f"several models are loaded ({', '.join(self._models)}); name one")
        self.last_used = entry.name
        return entry

    def loaded(self) -> list[LoadedEntry]:
        with self._lock:
            return list(self._models.values())

    # -- memory -----------------------------------------------------------------------------------
    @staticmethod
    def _split_device_share(entry: LoadedEntry, share: int | None, experts_wanted: int) -> int:
        """The KV/expert split of a device-resident model's share of VRAM (None: no limit); returns the
        expert cache's bytes and resizes the KV pool at the loop's next safe point.

        The policy: the weights and the largest step's activations are fixed; the KV blocks running sequences hold (at least one whole
        context) come next, since a session's KV demand only grows; then the expert cache (its working
        set does not grow); the pool's remaining blocks, which hold cached prefixes (speed only), last."""
        loop, model = entry.loop, entry.runtime.model
        per_block = loop.kv_block_bytes()
        if share is None or not per_block:
            target = loop.kv_full_blocks
        else:
            room = share - model.weight_device_bytes - loop.state_bytes() - loop.workspace_bytes() - experts_wanted
            target = max(loop.kv_floor_blocks(), min(loop.kv_full_blocks, room // per_block))
        if target != loop.kv_num_blocks:
            loop.resize_kv(target)
        if share is None:
            return experts_wanted
        # states and their checkpoints live with the pool; a step's activations need room beside both
        fixed = model.weight_device_bytes + loop.state_bytes() + loop.workspace_bytes()
        return min(experts_wanted, max(share - fixed - target * per_block, 0))

    def apply_cache_budget(self, cache_bytes: int | None) -> int:
        """Resize every loaded model's device expert cache to share ``cache_bytes`` (None = each its
        configured fraction); applied by each model's engine loop at its next safe point."""
        hybrid = [e for e in self.loaded() if hasattr(e.runtime.executor, "resize")]
        for entry in hybrid:
            bank = entry.runtime.loaded.bank
            wanted = int(entry.options.cache_fraction * bank.nbytes())
            share = None if cache_bytes is None else cache_bytes // max(len(hybrid), 1)
            if getattr(entry.runtime.model, "device", None) is not None:
                wanted = self._split_device_share(entry, share, wanted)
            elif share is not None:
                wanted = min(wanted, max(share - entry.stats.model_device_bytes, 0))
            slot_bytes = getattr(entry.runtime.executor, "slot_bytes", None) or bank.bytes_per_expert()
            slots = max(0, min(bank.num_slots, wanted // slot_bytes))
            if slots != entry.stats.cache_slots:
                entry.loop.run_at_safe_point(lambda e=entry, n=slots: e.runtime.executor.resize(n))
        return len(hybrid)
