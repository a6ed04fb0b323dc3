"""Write an FTW directory atomically: shards and extra files in a temp dir, ftw.json last, rename."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import sys
import zlib
from collections.abc import Callable, Mapping
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
    dst = Path(os.path.abspath(dst))
    _check_inputs(tensors, extra_files, shard_size)
    json.dumps(metadata, allow_nan=False)  # fail before writing gigabytes, not after
    remove_stale_temp_dirs(dst, on_stale_removed)
    if os.path.lexists(dst) and not overwrite:
        raise InvalidRequestError(f"{dst} already exists; pass --force (overwrite=True) to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _make_temp_dir(dst, "tmp")
    try:
        files, entries = _write_shards(tmp, tensors, shard_size, progress)
        extras = {name: _copy_extra(tmp / name, src) for name, src in extra_files.items()}
        index = FtwIndex(source_fingerprint, metadata, files, entries, extras)
        text = index_to_json(index)
        with open(tmp / INDEX_NAME, "w", encoding="utf-8") as f:
            f.write(text)
            _fsync(f)
        _fsync_dir(tmp)
        _install(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


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


def _write_shards(
    tmp: Path, tensors: Mapping[str, tuple[str, torch.Tensor]], shard_size: int, progress: Progress | None
) -> tuple[dict[str, FtwFile], dict[str, FtwTensor]]:
    """Pack tensors in order at aligned offsets; start a shard when the next would overflow."""
    total = sum(t.numel() * t.element_size() for _, t in tensors.values())
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    files: dict[str, FtwFile] = {}
    entries: dict[str, FtwTensor] = {}
    f: BinaryIO | None = None
    shard = ""
    pos = 0
    try:
        for name, (kind, t) in tensors.items():
            size = t.numel() * t.element_size()
            # a tensor bigger than shard_size alone gets a shard of its own
            if f is None or (pos > 0 and pos + align_up(size) > shard_size):
                if f is not None:
                    _close_shard(f, files, shard, pos)
                shard = shard_name(len(files))
                f = open(tmp / shard, "wb")
                pos = 0
            crc = _write_tensor(f, t, advance)
            f.write(_ZEROS[: align_up(size) - size])
            entries[name] = FtwTensor(name, kind, DTYPE_NAMES[t.dtype], tuple(t.shape), shard, pos, size, crc)
            pos += align_up(size)
        if f is not None:
            _close_shard(f, files, shard, pos)
            f = None
    finally:
        if f is not None:
            f.close()
    return files, entries


def _close_shard(f: BinaryIO, files: dict[str, FtwFile], shard: str, size: int) -> None:
    _fsync(f)
    f.close()
    files[shard] = FtwFile(shard, size)


def _write_tensor(f: BinaryIO, t: torch.Tensor, advance: Callable[[int], None]) -> int:
    """Write the tensor's raw bytes (bf16 included: viewed as uint8, never through numpy's dtypes)."""
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    mv = data.numpy().data
    crc = 0
    for start in range(0, mv.nbytes, _WRITE_CHUNK):
        chunk = mv[start : start + _WRITE_CHUNK]
        f.write(chunk)
        crc = zlib.crc32(chunk, crc)
        advance(chunk.nbytes)
    return crc


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
