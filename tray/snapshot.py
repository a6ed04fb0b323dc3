"""Snapshot: what the tray knows about the daemon at one moment, fetched over gRPC without ever raising."""

from __future__ import annotations

from dataclasses import dataclass

from moed.api.client import DaemonCallError, DaemonUnavailableError, MoedClient

# short, so a busy or wedged daemon delays the tray's refresh by at most this much per call
SNAPSHOT_TIMEOUT_S = 1.5


@dataclass(frozen=True)
class ModelEntry:
    name: str  # served name when loaded, else its catalog name ("qwen3:30b-a3b", "org/repo:Q4_K_M", a directory's)
    path: str  # where its files are
    is_loaded: bool
    source: str = "moed"  # moed | ollama | huggingface | lmstudio | path

    @property
    def load_arg(self) -> str:
        """What LoadModel is given: the path of a model in moed's folders, the name of one in another store."""
        return self.name if self.source in ("ollama", "huggingface", "lmstudio") else self.path


@dataclass(frozen=True)
class Snapshot:
    """Plain values from GetStatus + ListModels; `running=False` when no daemon answers, and
    `running=True` with `problem` set when one answers but the call failed."""

    running: bool
    address: str = ""
    state: str = ""  # idle | generating | loading | paused | stopping
    models: tuple[ModelEntry, ...] = ()  # on disk and loaded
    loaded_names: tuple[str, ...] = ()
    loading: tuple[tuple[str, float], ...] = ()  # models being loaded on demand: (name, fraction read)
    tokens_per_second: float = 0.0
    has_gpu: bool = False
    vram_total: int = 0
    vram_ours: int = 0
    vram_other_apps: int = 0
    vram_free: int = 0
    budget_bytes: int = 0
    cap_bytes: int = 0  # 0 = auto (no user cap)
    cache_bytes: int = 0  # the device expert cache of the most recently used model
    last_error: str = ""  # the daemon's last error (sticky on the daemon's side)
    problem: str = ""  # why the snapshot is incomplete (daemon gone, or it answered with an error)

    @property
    def is_paused(self) -> bool:
        return self.state == "paused"

    @property
    def cache_fill(self) -> float:
        """How full the expert cache is: its bytes over the VRAM budget (0..1); 0 without a budget."""
        if not self.running or self.budget_bytes <= 0:
            return 0.0
        return max(0.0, min(1.0, self.cache_bytes / self.budget_bytes))


def not_running(address: str, problem: str = "") -> Snapshot:
    return Snapshot(running=False, address=address, problem=problem)


def snapshot_from(address: str, status, models) -> Snapshot:
    """Translate a control_pb2.Status and a list of control_pb2.ModelInfo into a Snapshot."""
    mem = status.memory
    entries: dict[str, ModelEntry] = {}
    loading = tuple((info.name, float(info.load_fraction)) for info in models if info.state == "loading")
    for info in models:
        if info.state == "loading":
            continue
        key = info.path or info.name
        if key not in entries or info.loaded:  # a loaded entry wins over the on-disk one
            entries[key] = ModelEntry(name=info.name, path=info.path, is_loaded=bool(info.loaded),
                                      source=info.source or "moed")
    return Snapshot(
        running=True, address=address, state=status.state,
        models=tuple(sorted(entries.values(), key=lambda m: m.name.lower())),
        loaded_names=tuple(m.name for m in status.models), loading=loading,
        tokens_per_second=float(status.tokens_per_second),
        has_gpu=bool(mem.has_gpu), vram_total=int(mem.vram_total), vram_ours=int(mem.vram_ours),
        vram_other_apps=int(mem.vram_other_apps), vram_free=int(mem.vram_free),
        budget_bytes=int(mem.budget_bytes), cap_bytes=int(mem.cap_bytes),
        cache_bytes=int(status.engine.cache_bytes), last_error=status.last_error)


class SnapshotSource:
    """Keeps one client; after a failure it starts a fresh channel so a restarted daemon is seen at once
    (a failed gRPC channel otherwise waits out its reconnect backoff, which grows to minutes)."""

    def __init__(self, address: str, *, token: str | None = None, timeout: float = SNAPSHOT_TIMEOUT_S) -> None:
        self.address = address
        self.token = token
        self.timeout = timeout
        self._client: MoedClient | None = None

    def fetch(self) -> Snapshot:
        try:
            if self._client is None:
                self._client = MoedClient(self.address, token=self.token, timeout=self.timeout)
            status = self._client.status()
            models = self._client.list_models()
            return snapshot_from(self.address, status, models)
        except DaemonUnavailableError as exc:
            self._reset()
            return not_running(self.address, str(exc))
        except DaemonCallError as exc:  # it answers, but with an error (busy past the deadline, bad token)
            return Snapshot(running=True, address=self.address, problem=f"{exc.code.name}: {exc}")
        except Exception as exc:  # never raise into the refresh loop
            self._reset()
            return not_running(self.address, f"{type(exc).__name__}: {exc}")

    def _reset(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    def close(self) -> None:
        self._reset()


def fetch_snapshot(address: str, *, token: str | None = None, timeout: float = SNAPSHOT_TIMEOUT_S) -> Snapshot:
    """One-off snapshot (opens and closes a channel)."""
    source = SnapshotSource(address, token=token, timeout=timeout)
    try:
        return source.fetch()
    finally:
        source.close()
