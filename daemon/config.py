"""Process-wide settings: frozen dataclasses, and the only place that reads environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """Where moed keeps machine-specific data (calibration profiles): $MOED_CACHE_DIR or XDG cache."""
    explicit = os.environ.get("MOED_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moed"


@dataclass(frozen=True)
class EngineConfig:
    """How the expert engine runs a model (validated once)."""

    device: str = "auto"  # auto | cpu | emulated | cuda
    cache_fraction: float = 0.25  # device expert cache, as a fraction of the expert pool
    policy: str = "adaptive"
    policy_options: tuple[tuple[str, float], ...] = ()
    emulated_b_p: float = 16e9  # emulated device: PCIe expert-copy bandwidth, bytes/s
    emulated_b_dev: float = 900e9  # emulated device: device compute, bytes of weights/s
    adapt_bandwidth: bool = True  # keep re-estimating B_P / B_H from real steps
    cpu_kernel_threads: int | None = None  # numba threads for the CPU branch (None = all cores)
    prefill_buffers: int = 2  # layer buffers a long prefill streams through: 2 double-buffers, 1 loads on demand
    model_on_device: bool = True  # with a device: non-expert weights, KV cache and hidden states live there

    def __post_init__(self) -> None:
        from moed.errors import InvalidRequestError

        if self.device not in ("auto", "cpu", "emulated", "cuda"):
            raise InvalidRequestError(f"--device {self.device!r}: choose auto, cpu, emulated or cuda")
        if not 0.0 <= self.cache_fraction <= 1.0:
            raise InvalidRequestError(f"--cache-fraction must be between 0 and 1, got {self.cache_fraction}")
        if self.prefill_buffers not in (1, 2):
            raise InvalidRequestError(f"prefill_buffers must be 1 (on-demand loading) or 2 (double buffering), "
                                      f"got {self.prefill_buffers}")
        for name, value in (("emulated B_P", self.emulated_b_p), ("emulated device bandwidth", self.emulated_b_dev)):
            if not value > 0:
                raise InvalidRequestError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class PathEnv:
    """The environment variables that decide where the daemon keeps its files (see moed.service.paths)."""

    xdg_runtime_dir: str | None = None  # $XDG_RUNTIME_DIR: per-login runtime dir (socket, lock)
    xdg_state_home: str | None = None  # $XDG_STATE_HOME: logs go to <it>/moed/logs
    xdg_data_home: str | None = None  # $XDG_DATA_HOME: models in <it>/moed/models
    local_appdata: str | None = None  # %LOCALAPPDATA% (Windows): logs, runtime files, models
    models: str | None = None  # $MOED_MODELS: model search dirs, os.pathsep-separated
    runtime_dir: str | None = None  # $MOED_RUNTIME_DIR: overrides the runtime dir (tests, several users)
    log_dir: str | None = None  # $MOED_LOG_DIR: overrides the log dir


def path_env() -> PathEnv:
    """Read the path-related environment variables once (empty values count as unset)."""

    def get(name: str) -> str | None:
        return os.environ.get(name) or None

    return PathEnv(
        xdg_runtime_dir=get("XDG_RUNTIME_DIR"),
        xdg_state_home=get("XDG_STATE_HOME"),
        xdg_data_home=get("XDG_DATA_HOME"),
        local_appdata=get("LOCALAPPDATA"),
        models=get("MOED_MODELS"),
        runtime_dir=get("MOED_RUNTIME_DIR"),
        log_dir=get("MOED_LOG_DIR"),
    )


def gpu_memory_file() -> Path | None:
    """$MOED_GPU_MEMORY_FILE: read simulated GPU memory from this JSON file instead of NVML (tests)."""
    value = os.environ.get("MOED_GPU_MEMORY_FILE")
    return Path(value) if value else None


def test_runtime_hook() -> str | None:
    """$MOED_TEST_RUNTIME_HOOK ("module:function"): tests only. The daemon hands every model it loads to that
    function and serves the runtime it returns; the real-agent tests put a scripted logits source in front of
    the demo model this way (moed.engine.runtime_hook). Unset in normal use."""
    return os.environ.get("MOED_TEST_RUNTIME_HOOK") or None


def xdg_config_home() -> Path:
    """$XDG_CONFIG_HOME, else ~/.config: where OpenCode keeps opencode.json (`moed launch opencode`)."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def codex_home() -> Path:
    """$CODEX_HOME, else ~/.codex: where Codex CLI keeps config.toml (`moed launch codex`)."""
    return Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")


def socket_override() -> str | None:
    """$MOED_SOCKET: the daemon address clients use (and `moed serve` listens on) instead of the default."""
    return os.environ.get("MOED_SOCKET") or None


def daemon_token(token: str | None = None, token_file: str | os.PathLike | None = None) -> str | None:
    """The token a daemon requires as call metadata (mandatory on a non-loopback address) and clients send.

    The first that is set: ``token`` (`moed serve --token`), the file ``token_file`` (`--token-file`),
    $MOED_TOKEN, the file $MOED_TOKEN_FILE. A token file must be private to its owner (see
    read_token_file); a token on a command line is visible to every local user in the process list.
    """
    if token:
        return token
    if token_file:
        return read_token_file(token_file)
    if os.environ.get("MOED_TOKEN"):
        return os.environ["MOED_TOKEN"]
    if os.environ.get("MOED_TOKEN_FILE"):
        return read_token_file(os.environ["MOED_TOKEN_FILE"], what="$MOED_TOKEN_FILE")
    return None


MAX_TOKEN_FILE_BYTES = 4096


def read_token_file(path: str | os.PathLike, *, what: str = "token file") -> str:
    """The token in the file at ``path``, surrounding whitespace stripped.

    InvalidRequestError (one line, saying what to do) when the file cannot be read, is not a regular file,
    may be read or written by the group or other users (POSIX modes; the fix is ``chmod 600``), is empty,
    or holds more than one line or characters that cannot travel as gRPC metadata (printable ASCII only).
    """
    import stat

    from moed.errors import InvalidRequestError

    shown = os.fspath(path)
    path = Path(os.path.expanduser(shown))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise InvalidRequestError(f"{what} {shown}: cannot read it ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the path names a moment later
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequestError(f"{what} {shown} is not a regular file")
        if os.name == "posix" and st.st_mode & 0o077:
            raise InvalidRequestError(
                f"{what} {shown} is accessible to other users (mode {stat.S_IMODE(st.st_mode):04o}); a token "
                f"must be private: run `chmod 600 {shown}`")
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise InvalidRequestError(f"{what} {shown} is larger than {MAX_TOKEN_FILE_BYTES} bytes; it should hold "
                                  "only the token")
    token = data.decode("ascii", errors="replace").strip()
    if not token:
        raise InvalidRequestError(f"{what} {shown} is empty; write the token into it (one line)")
    if not all(" " <= c <= "~" for c in token):
        raise InvalidRequestError(f"{what} {shown}: the token must be one line of printable ASCII characters")
    return token
