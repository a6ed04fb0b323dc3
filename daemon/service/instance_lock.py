"""One daemon per user: an exclusive lock on the lock file, held for the process lifetime.

The lock file doubles as the pid file: it holds JSON {pid, address, started}. The OS drops the
lock when the process dies (however it dies), so a stale file from a crashed daemon never blocks
the next start. The file is never deleted -- deleting it would let two daemons lock two
different files under the same name; a released lock leaves it empty.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from moed.errors import AlreadyRunningError

if sys.platform.startswith("win"):
    import msvcrt

    fcntl = None
else:
    import fcntl

    msvcrt = None

# Windows locks are mandatory byte ranges: lock one byte far past the JSON so readers can still read it
_WIN_LOCK_OFFSET = 1 << 20
# a holder that just took the lock may not have written its JSON yet
_READ_RETRY_S = 1.0


@dataclass(frozen=True)
class LockHolder:
    """What the running daemon wrote into the lock file."""

    pid: int
    address: str | None
    started: str  # ISO 8601, UTC


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, _WIN_LOCK_OFFSET, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except OSError:  # BlockingIOError (EWOULDBLOCK) on POSIX, PermissionError on Windows
        return False


def _unlock(fd: int) -> None:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        else:
            os.lseek(fd, _WIN_LOCK_OFFSET, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    except OSError:
        pass


def _parse(text: str) -> LockHolder | None:
    try:
        data = json.loads(text)
        pid = data["pid"]
        if not isinstance(pid, int) or isinstance(pid, bool):
            return None
        address = data.get("address")
        return LockHolder(pid=pid, address=address if isinstance(address, str) and address else None,
                          started=str(data.get("started", "")))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def read_lock_holder(path: Path) -> LockHolder | None:
    """What the lock file says about the running daemon, or None when empty, unreadable or missing.

    This does not check that the lock is held; `InstanceLock.acquire` is the test that a daemon runs.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return _parse(f.read())
    except OSError:
        return None


def _already_running(path: Path, holder: LockHolder | None) -> AlreadyRunningError:
    if holder is None:
        return AlreadyRunningError(
            f"moed is already running (another process holds {path}); stop it before starting another")
    where = f" on {holder.address}" if holder.address else f", still starting (lock file {path})"
    return AlreadyRunningError(
        f"moed is already running (pid {holder.pid}){where}; connect to it, or stop it first "
        f"(`moed stop` or kill {holder.pid})", pid=holder.pid, address=holder.address)


class InstanceLock:
    """The per-user daemon lock. `acquire()` raises AlreadyRunningError when another daemon holds it.

    The descriptor is not inherited by exec'd children (Python's default); do not fork() while
    holding it without exec, or the child keeps the lock alive after the daemon exits.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._pid = os.getpid()
        self._address: str | None = None
        self._started = ""

    @property
    def is_held(self) -> bool:
        return self._fd is not None

    def acquire(self, address: str | None = None) -> "InstanceLock":
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o600)
        if not _try_lock(fd):
            os.close(fd)
            raise _already_running(self.path, self._wait_for_holder())
        self._fd = fd
        self._started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._address = address
        self._write()
        return self

    def _wait_for_holder(self) -> LockHolder | None:
        """The holder's JSON; it may take a moment after it locked the file to write it."""
        deadline = time.monotonic() + _READ_RETRY_S
        while True:
            holder = read_lock_holder(self.path)
            if holder is not None or time.monotonic() >= deadline:
                return holder
            time.sleep(0.02)

    def update_address(self, address: str) -> None:
        """Record where the server listens, once it has bound."""
        if self._fd is None:
            raise RuntimeError("InstanceLock.update_address: the lock is not held")
        self._address = address
        self._write()

    def _write(self) -> None:
        data = json.dumps({"pid": self._pid, "address": self._address, "started": self._started}).encode()
        fd = self._fd
        # rewrite in place (same inode: the lock is on it); pad, then trim, so a reader never sees ""
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)
        os.ftruncate(fd, len(data))
        try:
            os.fsync(fd)
        except OSError:
            pass

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # no stale pid/address for readers
        except OSError:
            pass
        _unlock(fd)
        os.close(fd)

    def __enter__(self) -> "InstanceLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # the OS would drop the lock at exit anyway; this keeps tests that drop the object tidy
        try:
            self.release()
        except Exception:
            pass


def acquire_instance_lock(path: str | Path | None = None, address: str | None = None) -> InstanceLock:
    """Take the per-user daemon lock (default: paths.lock_file_path()) or raise AlreadyRunningError."""
    if path is None:
        from moed.service.paths import lock_file_path

        path = lock_file_path()
    return InstanceLock(path).acquire(address)
