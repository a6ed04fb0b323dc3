"""Write an FTW directory atomically: shards and extra files in a temp dir, ftw.json last, rename."""

from __future__ import annotations

import errno
import json
import math
import logging
import os
import re
import secrets
import shutil
import stat
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

import torch

from moed.errors import InvalidRequestError
from moed.weights.ftw_format import (
    ALIGNMENT,
    DEFAULT_SHARD_SIZE,
    DTYPE_NAMES,
    INDEX_NAME,
    KINDS,
    FtwExtraFile,
    FtwFile,
    FtwIndex,
    FtwTensor,
    align_up,
    index_to_json,
    is_plain_file_name,
    shard_name,
)

_WRITE_CHUNK = 64 << 20  # bounds the progress granularity; large writes bypass Python's buffer
_ZEROS = bytes(ALIGNMENT)

Progress = Callable[[int, int], None]
StaleReport = Callable[[Path, int, int], None]  # (removed directory, its size in bytes, the dead writer's pid)

log = logging.getLogger("moed.weights")


def write_ftw(
    dst: str | Path,
    tensors: Mapping[str, tuple[str, torch.Tensor]],
    *,
    metadata: dict[str, Any],
    source_fingerprint: str,
    extra_files: Mapping[str, str | Path | bytes] = {},
    shard_size: int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
    on_stale_removed: StaleReport | None = None,
) -> Path:
    """Write ``tensors`` (name -> (kind, tensor)) as an FTW directory at ``dst``; returns ``dst``.

    Nothing loadable ever appears at ``dst`` before the whole directory is on disk: a crash
    leaves at most a hidden ``.<name>.tmp-<pid>-<random>`` (or ``.old-``) directory beside it,
    which the next write to the same ``dst`` removes once its writer is gone (see
    ``remove_stale_temp_dirs``; each removal is passed to ``on_stale_removed``, else logged).
    """
    _check_inputs(tensors, extra_files, shard_size)
    specs = [TensorSpec(name, kind, t.dtype, tuple(t.shape)) for name, (kind, t) in tensors.items()]
    with FtwStreamWriter(dst, specs, shard_size=shard_size, overwrite=overwrite, progress=progress,
                         metadata_check=metadata, on_stale_removed=on_stale_removed) as writer:
        for name, (_, t) in tensors.items():
            writer.write(name, t)
        return writer.finish(metadata=metadata, source_fingerprint=source_fingerprint, extra_files=extra_files)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the writer reserves room for before its data arrives."""

    name: str
    kind: str  # one of KINDS
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class FtwStreamWriter:
    """Writes an FTW directory whose tensors arrive piece by piece (a converter's bounded working set).

    The layout (shard and aligned offset of every tensor) is fixed up front from the specs; then
    each tensor is written whole (``write``) or as consecutive row blocks along dim 0
    (``write_rows``, in order per tensor; blocks of different tensors may interleave), with its
    CRC32 accumulated as it goes. ``finish`` checks every byte was written, writes ftw.json last
    and renames the temp directory into place: nothing loadable exists at ``dst`` before that, and
    leaving the ``with`` block without ``finish`` (an error, Ctrl-C) deletes the temp directory.
    """

    def __init__(self, dst: str | Path, specs: list[TensorSpec], *, shard_size: int = DEFAULT_SHARD_SIZE,
                 overwrite: bool = False, progress: Progress | None = None, metadata_check: Any = None,
                 on_stale_removed: StaleReport | None = None) -> None:
        if shard_size < ALIGNMENT:
            raise InvalidRequestError(f"shard size {shard_size} is too small; it must be at least {ALIGNMENT} bytes")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError("FtwStreamWriter: tensor names must be unique")
        for spec in specs:
            if spec.kind not in KINDS or spec.dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor {spec.name!r}: kind {spec.kind!r} / dtype {spec.dtype} cannot be stored in FTW")
        if metadata_check is not None:
            json.dumps(metadata_check, allow_nan=False)  # fail before writing gigabytes, not after
        self.dst = Path(os.path.abspath(dst))
        remove_stale_temp_dirs(self.dst, on_stale_removed)
        if os.path.lexists(self.dst) and not overwrite:
            raise InvalidRequestError(f"{self.dst} already exists; pass --force (overwrite=True) to replace it")
        self.overwrite = overwrite
        self.progress = progress
        self.specs = {spec.name: spec for spec in specs}
        self.total = sum(spec.nbytes for spec in specs)
        self.done = 0
        self._entries: dict[str, tuple[str, int]] = {}  # name -> (shard, offset)
        self._files: dict[str, int] = {}  # shard -> size
        shard, pos = "", 0
        for spec in specs:
            size = spec.nbytes
            if not shard or (pos > 0 and pos + align_up(size) > shard_size):  # a big tensor gets its own shard
                if shard:
                    self._files[shard] = pos
                shard, pos = shard_name(len(self._files)), 0
            self._entries[spec.name] = (shard, pos)
            pos += align_up(size)
        if shard:
            self._files[shard] = pos
        self._written = {name: 0 for name in self.specs}  # bytes written so far, per tensor
        self._crc = {name: 0 for name in self.specs}
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _make_temp_dir(self.dst, "tmp")
        self._fds: dict[str, int] = {}
        self._finished = False
        try:
            for name, size in self._files.items():
                fd = os.open(self.tmp / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
                self._fds[name] = fd
                os.ftruncate(fd, size)  # zero padding between tensors comes for free (sparse until written)
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> "FtwStreamWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._finished:
            self.abort()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_rows(name, 0, tensor)

    def write_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Rows ``start .. start + len(rows)`` of tensor ``name`` (the whole tensor when start is 0 and
        rows has its full shape); each call must begin where the previous one for ``name`` ended."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"FtwStreamWriter: no tensor {name!r} was reserved")
        whole = start == 0 and tuple(rows.shape) == spec.shape
        if rows.dtype != spec.dtype or (not whole and (rows.dim() != len(spec.shape) or tuple(rows.shape[1:]) != spec.shape[1:])):
            raise ValueError(f"tensor {name!r}: got {rows.dtype} {tuple(rows.shape)}, reserved {spec.dtype} {spec.shape}")
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape and spec.shape[0] else spec.nbytes
        offset = 0 if whole else start * row_bytes
        if offset != self._written[name]:
            raise ValueError(f"tensor {name!r}: rows from {start} arrive, but {self._written[name] // max(row_bytes, 1)} "
                             "rows were written so far (blocks must come in order)")
        data = rows.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        mv = data.numpy().data
        if offset + mv.nbytes > spec.nbytes:
            raise ValueError(f"tensor {name!r}: {offset + mv.nbytes} bytes is more than its {spec.nbytes}")
        shard, base = self._entries[name]
        fd = self._fds[shard]
        for pos in range(0, mv.nbytes, _WRITE_CHUNK):
            chunk = mv[pos : pos + _WRITE_CHUNK]
            _pwrite_all(fd, chunk, base + offset + pos)
            self._crc[name] = zlib.crc32(chunk, self._crc[name])
            self.done += chunk.nbytes
            if self.progress is not None:
                self.progress(self.done, self.total)
        self._written[name] += mv.nbytes

    def finish(self, *, metadata: dict[str, Any], source_fingerprint: str,
               extra_files: Mapping[str, str | Path | bytes] = {}) -> Path:
        missing = [n for n, spec in self.specs.items() if self._written[n] != spec.nbytes]
        if missing:
            raise ValueError(f"FtwStreamWriter: {len(missing)} tensors are incomplete, e.g. {missing[0]!r}")
        for name in extra_files:
            if not is_plain_file_name(name) or name == INDEX_NAME or name.startswith("shard-"):
                raise ValueError(f"extra file name {name!r} must be a plain file name, not {INDEX_NAME} or shard-*")
        try:
            for fd in self._fds.values():
                os.fsync(fd)
            self._close_fds()
            files = {name: FtwFile(name, size) for name, size in self._files.items()}
            entries = {n: FtwTensor(n, spec.kind, DTYPE_NAMES[spec.dtype], spec.shape, *self._entries[n], spec.nbytes,
                                    self._crc[n]) for n, spec in self.specs.items()}
            extras = {name: _copy_extra(self.tmp / name, src) for name, src in extra_files.items()}
            text = index_to_json(FtwIndex(source_fingerprint, metadata, files, entries, extras))
            with open(self.tmp / INDEX_NAME, "w", encoding="utf-8") as f:
                f.write(text)
                _fsync(f)
            _fsync_dir(self.tmp)
            _install(self.tmp, self.dst, self.overwrite)
        except BaseException:
            self.abort()
            raise
        self._finished = True
        return self.dst

    def abort(self) -> None:
        """Close and delete everything written so far (idempotent)."""
        self._close_fds()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _check_inputs(
    tensors: Mapping[str, tuple[str, torch.Tensor]], extra_files: Mapping[str, object], shard_size: int
) -> None:
    if shard_size < ALIGNMENT:
        raise InvalidRequestError(f"shard size {shard_size} is too small; it must be at least {ALIGNMENT} bytes")
    for name, item in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} must be a non-empty string")
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"tensor {name!r}: expected a (kind, torch.Tensor) pair, got {type(item).__name__}")
        kind, t = item
        if kind not in KINDS:
            raise ValueError(f"tensor {name!r} has kind {kind!r}, expected one of {KINDS}")
        if t.dtype not in DTYPE_NAMES or t.layout != torch.strided:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype} / layout {t.layout}; FTW stores "
                             f"dense {', '.join(DTYPE_NAMES.values())}")
    for name in extra_files:
        if not is_plain_file_name(name) or name == INDEX_NAME or name.startswith("shard-"):
            raise ValueError(f"extra file name {name!r} must be a plain file name, not {INDEX_NAME} or shard-*")


def _temp_name_pattern(dst: Path) -> re.Pattern[str]:
    """The names _make_temp_dir gives: ``.<name>.tmp-<pid>-<8 hex>`` and ``.<name>.old-<pid>-<8 hex>``."""
    return re.compile(rf"\.{re.escape(dst.name)}\.(tmp|old)-([1-9][0-9]{{0,9}})-[0-9a-f]{{8}}")


def remove_stale_temp_dirs(dst: str | Path, report: StaleReport | None = None) -> list[tuple[Path, int]]:
    """Delete the temp directories that writes to ``dst`` killed before they finished left beside it.

    Only directories named like ours whose writer process is gone: its pid is not alive, or (for a
    ``.tmp-`` directory, where /proc tells process start times) the pid now belongs to a process
    that started after the directory's newest file was last written, i.e. a reused pid. A directory
    of a live writer (another conversion to the same destination, still running) is never touched;
    where liveness cannot be told (another user's process) the directory is kept. An ``.old-``
    directory (the previous model, moved aside while a new one was installed) is only removed once
    ``dst`` exists again and its pid is gone, so the only copy of a model is never deleted.
    Returns (path, bytes) for each directory removed.
    """
    dst = Path(os.path.abspath(dst))
    pattern = _temp_name_pattern(dst)
    try:
        names = os.listdir(dst.parent)
    except OSError:
        return []  # no parent yet: nothing can be stale
    removed = []
    for name in sorted(names):
        match = pattern.fullmatch(name)
        if match is None:
            continue
        what, pid = match.group(1), int(match.group(2))
        path = dst.parent / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue  # a symlink or a file: not something we made
        size, last_written = _tree_stats(path, st.st_mtime)
        if what == "old":
            # killed between the two renames (no dst): this is the model, leave it for the user; its files
            # are as old as that model, so a live pid is kept whatever it started
            if not os.path.lexists(dst) or _pid_exists(pid):
                continue
        elif _writer_may_be_alive(pid, last_written):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            log.warning("could not remove the stale temp directory %s (%d bytes)", path, size)
            continue
        removed.append((path, size))
        if report is not None:
            report(path, size, pid)
        else:
            log.warning("removed %s (%d bytes) left by a write that was killed (pid %d is gone)", path, size, pid)
    return removed


def _tree_stats(path: Path, dir_mtime: float) -> tuple[int, float]:
    """Total bytes of the files under ``path`` and the newest modification time (the directory's included)."""
    total, newest = 0, dir_mtime
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime)
    return total, newest


def _writer_may_be_alive(pid: int, last_written: float) -> bool:
    """False only when process ``pid`` is certainly not the one that wrote a directory whose newest
    file was modified at ``last_written``: no such process, or one that started after that (the pid
    was reused). A writer that is still writing keeps ``last_written`` at about now."""
    if not _pid_exists(pid):
        return False
    started = _process_start_time(pid)
    # the writer started before it wrote; /proc's boot time is whole seconds, so allow some slack
    return started is None or started <= last_written + 2.0


def _pid_exists(pid: int) -> bool:
    if sys.platform == "win32":
        return _windows_pid_exists(pid)
    try:
        os.kill(pid, 0)  # signal 0: checks only
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists (another user's); anything else: do not guess
        return True
    return True


def _windows_pid_exists(pid: int) -> bool:
    """os.kill(pid, 0) would terminate the process on Windows: ask the kernel instead (True if unsure)."""
    try:
        import ctypes
        from ctypes import wintypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
        kernel32.OpenProcess.restype = wintypes.HANDLE
        kernel32.OpenProcess.argtypes = (wintypes.DWORD, wintypes.BOOL, wintypes.DWORD)
        kernel32.GetExitCodeProcess.argtypes = (wintypes.HANDLE, ctypes.POINTER(wintypes.DWORD))
        kernel32.CloseHandle.argtypes = (wintypes.HANDLE,)
        handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return ctypes.get_last_error() != 87  # ERROR_INVALID_PARAMETER: no such process
        try:
            code = wintypes.DWORD()
            if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
                return True
            return code.value == 259  # STILL_ACTIVE
        finally:
            kernel32.CloseHandle(handle)
    except Exception:
        return True


def _process_start_time(pid: int) -> float | None:
    """The process's start as a Unix time, from /proc (Linux); None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode("ascii", "replace")
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f.read().decode("ascii", "replace").splitlines()
                        if line.startswith("btime "))
        # the command name (field 2) is in parentheses and may hold spaces: split after the last ')'
        start_ticks = int(fields[fields.rindex(")") + 2 :].split()[19])  # field 22, starttime
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def _make_temp_dir(dst: Path, what: str) -> Path:
    while True:
        p = dst.parent / f".{dst.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            p.mkdir()  # mode 0o777 minus umask, unlike tempfile.mkdtemp's 0o700
            return p
        except FileExistsError:
            continue


def _copy_extra(dst: Path, src: str | Path | bytes) -> FtwExtraFile:
    crc = size = 0
    with open(dst, "wb") as out:
        if isinstance(src, (bytes, bytearray, memoryview)):
            out.write(src)
            crc, size = zlib.crc32(src), len(src)
        else:
            with open(src, "rb") as inp:
                while block := inp.read(_WRITE_CHUNK):
                    out.write(block)
                    crc, size = zlib.crc32(block, crc), size + len(block)
        _fsync(out)
    return FtwExtraFile(dst.name, size, crc)


def _install(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished directory to ``dst``; an old ``dst`` is moved aside first, then deleted."""
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        _fsync_dir(dst.parent)
        return
    if not overwrite:  # appeared while we were writing
        raise InvalidRequestError(f"{dst} already exists; pass --force (overwrite=True) to replace it")
    old = dst.parent / f".{dst.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    _fsync_dir(dst.parent)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


def _fsync(f: IO[Any]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # some filesystems cannot fsync a directory; the data files were already synced
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)
