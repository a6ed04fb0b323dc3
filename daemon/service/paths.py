"""Where the daemon keeps its files: runtime dir (socket, lock), logs, and the model search path.

Environment variables come in through `moed.config.path_env()`; every function here also takes
an explicit `env` and `platform` so tests can ask for any machine's layout.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from moed.config import PathEnv, path_env
from moed.errors import MoedError

SOCKET_NAME = "moed.sock"
LOCK_NAME = "moed.lock"
# AF_UNIX paths are limited to 108 bytes on Linux (104 on macOS), including the terminating NUL
MAX_SOCKET_PATH = 103
DEFAULT_TCP_ADDRESS = "localhost:50551"


def _is_windows(platform: str) -> bool:
    return platform.startswith("win")


def _user_id() -> str:
    getuid = getattr(os, "getuid", None)
    if getuid is not None:
        return str(getuid())
    import getpass  # Windows: no uids

    return getpass.getuser()


def runtime_dir(env: PathEnv | None = None, platform: str = sys.platform, *, create: bool = True) -> Path:
    """$MOED_RUNTIME_DIR, else $XDG_RUNTIME_DIR/moed, else /tmp/moed-<uid> (Windows: %LOCALAPPDATA%\\moed\\run).

    Created with mode 0700. A directory that exists but belongs to another user (someone
    pre-created /tmp/moed-<uid>) is refused: our socket and lock must not live in it.
    """
    env = env if env is not None else path_env()
    if env.runtime_dir:
        path = Path(env.runtime_dir)
    elif env.xdg_runtime_dir and not _is_windows(platform):
        path = Path(env.xdg_runtime_dir) / "moed"
    elif _is_windows(platform):
        path = Path(env.local_appdata or Path.home() / "AppData" / "Local") / "moed" / "run"
    else:
        path = Path("/tmp") / f"moed-{_user_id()}"  # not $TMPDIR: macOS's is too long for a socket path
    if create:
        _make_private_dir(path)
    return path


def _make_private_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise MoedError(f"cannot create the moed runtime directory {path}: {exc}; "
                        "set MOED_RUNTIME_DIR to a directory you own") from exc
    if not hasattr(os, "getuid"):
        return
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise MoedError(f"the moed runtime directory {path} is not a directory owned by you (uid {os.getuid()}); "
                        "remove it or set MOED_RUNTIME_DIR to a directory you own")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def socket_path(env: PathEnv | None = None, platform: str = sys.platform) -> Path:
    """The default Unix socket the daemon listens on: <runtime dir>/moed.sock."""
    return runtime_dir(env, platform) / SOCKET_NAME


def default_address(env: PathEnv | None = None, platform: str = sys.platform) -> str:
    """The gRPC address to listen on / connect to: unix://<socket> (Windows: a localhost TCP port).

    Raises MoedError when the socket path is too long for AF_UNIX.
    """
    if _is_windows(platform):
        return DEFAULT_TCP_ADDRESS
    path = socket_path(env, platform)
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise MoedError(f"the socket path {path} is longer than the {MAX_SOCKET_PATH} bytes Unix sockets allow; "
                        "set MOED_RUNTIME_DIR to a shorter directory")
    return f"unix://{path}"


def lock_file_path(env: PathEnv | None = None, platform: str = sys.platform) -> Path:
    """The instance lock (also the pid file): <runtime dir>/moed.lock, JSON {pid, address, started}."""
    return runtime_dir(env, platform) / LOCK_NAME


def log_dir(env: PathEnv | None = None, platform: str = sys.platform) -> Path:
    """$MOED_LOG_DIR, else per platform: Linux $XDG_STATE_HOME/moed/logs (~/.local/state/moed/logs),
    macOS ~/Library/Logs/moed, Windows %LOCALAPPDATA%\\moed\\logs. Not created here."""
    env = env if env is not None else path_env()
    if env.log_dir:
        return Path(env.log_dir)
    if platform == "darwin":
        return Path.home() / "Library" / "Logs" / "moed"
    if _is_windows(platform):
        return Path(env.local_appdata or Path.home() / "AppData" / "Local") / "moed" / "logs"
    return Path(env.xdg_state_home or Path.home() / ".local" / "state") / "moed" / "logs"


def model_dirs(env: PathEnv | None = None, platform: str = sys.platform) -> list[Path]:
    """Where to look for models, in order: $MOED_MODELS (os.pathsep-separated: ':' or ';' on
    Windows), else the user's data dir (~/.local/share/moed/models, or $XDG_DATA_HOME/moed/models;
    Windows %LOCALAPPDATA%\\moed\\models) and ./models. The directories need not exist."""
    env = env if env is not None else path_env()
    if env.models:
        sep = ";" if _is_windows(platform) else ":"
        return [Path(part).expanduser() for part in env.models.split(sep) if part]
    if _is_windows(platform):
        data = Path(env.local_appdata or Path.home() / "AppData" / "Local") / "moed" / "models"
    else:
        data = Path(env.xdg_data_home or Path.home() / ".local" / "share") / "moed" / "models"
    return [data, Path.cwd() / "models"]
