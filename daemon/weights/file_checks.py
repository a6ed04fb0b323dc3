"""Model files must be regular files: a FIFO, socket or device in a model directory would block a read forever."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from moed.errors import ModelFormatError

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def require_regular_file(path: Path) -> Path:
    """Return ``path`` if it is (a symlink to) a regular file; raise ModelFormatError naming what it is.

    Checked with stat() before anything opens the file: opening a FIFO blocks until a writer
    appears, and some readers (safetensors) block inside native code that holds the GIL.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: not found (a dangling symlink?)") from None
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot stat ({exc.strerror})") from None
    if stat.S_ISREG(mode):
        return path
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    raise ModelFormatError(f"{path} is {kind}, not a regular file; model files must be regular files "
                           "(remove or replace it)")
