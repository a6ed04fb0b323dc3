"""One daemon per user: an exclusive lock on the lock file, held for the process lifetime.

The lock file doubles as the pid file: it holds JSON {pid, address, started}. The OS drops the
lock when the process dies (however it dies), so a stale file from a crashed daemon never blocks
the next start. The file is never deleted -- deleting it would let two daemons lock two
different files under the same name; a released lock leaves it empty. A daemon that takes the
lock and finds a previous holder's JSON still there (that daemon died without releasing it: a
SIGKILL, a crash, a power cut) says so in one line, logged and printed:
"recovered a stale lock left by pid N (not running)".
"""

from __future__ import annotations

import json
import logging
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

log = logging.getLogger("moed.service.lock")


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


def _pid_state(pid: int) -> str:
    """Why a pid that left a stale lock no longer holds it: "not running", or what runs under it now."""
    if pid == os.getpid():  # e.g. pid 1 in a container again: an earlier process with our pid
        return "not running"
    try:
        import psutil

        running = psutil.pid_exists(pid)  # never os.kill(pid, 0): on Windows that terminates the process
    except Exception:  # psutil missing or refused: say what is certain
        return "not running"
    return "that pid now belongs to another process" if running else "not running"


def stale_lock_message(path: Path, holder: LockHolder) -> str:
    """The one line a daemon logs and prints when it took over the lock of a daemon that died holding it."""
    where = f", last listening on {holder.address}" if holder.address else ""
    since = f", started {holder.started}" if holder.started else ""
    return f"recovered a stale lock left by pid {holder.pid} ({_pid_state(holder.pid)}): {path}{where}{since}"


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
        # the previous holder whose JSON was still in the file when we took the lock: it died holding it
        self.recovered_from: LockHolder | None = None

    @property
    def is_held(self) -> bool:
        return self._fd is not None

    def acquire(self, address: str | None = None, *, announce: bool = True) -> "InstanceLock":
        """Take the lock or raise AlreadyRunningError. A previous holder's JSON still in the file
        means that daemon died without releasing it: `recovered_from` names it and, with `announce`,
        one line says so (logged as a warning and printed on stdout)."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o600)
        if not _try_lock(fd):
            os.close(fd)
            raise _already_running(self.path, self._wait_for_holder())
        self._fd = fd
        self.recovered_from = self._stale_holder(fd)
        self._started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._address = address
        self._write()
        if self.recovered_from is not None and announce:
            message = stale_lock_message(self.path, self.recovered_from)
            log.warning("%s", message)
            print(f"moed: {message}", flush=True)
        return self

    @staticmethod
    def _stale_holder(fd: int) -> LockHolder | None:
        """What a dead holder left in the file we now lock (None: empty, i.e. released cleanly)."""
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            data = b""
            while len(data) < _WIN_LOCK_OFFSET:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            return None
        return _parse(data.decode("utf-8", errors="replace")) if data.strip() else None

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
