"""Daemon logging: a rotating file in the log dir, plus stderr when a person is watching."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

from moed.errors import InvalidRequestError

LOG_NAME = "moed.log"
FORMAT = "%(asctime)s %(levelname)-7s %(name)s [%(threadName)s] %(message)s"


class _MoedHandler:
    """Marks the handlers setup_logging installed, so a second call replaces them instead of doubling."""


class _RotatingFile(logging.handlers.RotatingFileHandler, _MoedHandler):
    pass


class _Stderr(logging.StreamHandler, _MoedHandler):
    pass


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(level.strip().upper())
    if not isinstance(value, int):
        raise InvalidRequestError(f"log level {level!r}: choose debug, info, warning, error or critical")
    return value


def setup_logging(log_dir: str | Path, level: str | int = "INFO", *, max_bytes: int = 10 * 1024 * 1024,
                  backup_count: int = 5, stderr: bool | None = None) -> Path:
    """Send the root logger to <log_dir>/moed.log (rotated at `max_bytes`, `backup_count` old files kept)
    and, when `stderr` is True (default: stderr is a terminal), to stderr too. Returns the log file.

    Calling it again replaces the handlers it installed before; other handlers are left alone.
    """
    log_dir = Path(log_dir)
    try:
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidRequestError(f"cannot create the log directory {log_dir}: {exc}; "
                                  "set MOED_LOG_DIR to a writable directory") from exc
    path = log_dir / LOG_NAME
    numeric = _level(level)
    formatter = logging.Formatter(FORMAT)

    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _MoedHandler)]:
        root.removeHandler(handler)
        handler.close()

    file_handler = _RotatingFile(path, maxBytes=max_bytes, backupCount=backup_count, encoding="utf-8")
    file_handler.setFormatter(formatter)
    root.addHandler(file_handler)
    if stderr is None:
        stderr = bool(getattr(sys.stderr, "isatty", lambda: False)())
    if stderr:
        console = _Stderr(sys.stderr)
        console.setFormatter(formatter)
        root.addHandler(console)
    root.setLevel(numeric)
    logging.captureWarnings(True)
    return path
