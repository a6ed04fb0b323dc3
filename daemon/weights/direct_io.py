"""Aligned host buffers and parallel positional reads into them, with O_DIRECT where allowed."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moed.errors import ModelFormatError

ALIGN = 4096  # O_DIRECT wants buffer address, file offset and length multiples of the block size
DEFAULT_CHUNK = 32 << 20  # big enough to stream at full NVMe speed, small enough to spread over threads


def _iov_max() -> int:
    try:
        return max(1, min(512, os.sysconf("SC_IOV_MAX")))
    except (AttributeError, ValueError, OSError):
        return 16  # POSIX minimum


MAX_IOV = _iov_max()  # buffers per scatter read
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux only; elsewhere every read is plain
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def align_up(n: int, alignment: int = ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


def aligned_empty(nbytes: int) -> torch.Tensor:
    """Uninitialised uint8 tensor of ``align_up(nbytes)`` bytes whose data starts ALIGN-aligned.

    Views of it (``t[:n].view(dtype).view(shape)``) keep the over-allocated storage alive.
    Pages are not touched here, so reading into the buffer is the first (and only) write.
    Buffers of 2 MiB and more are transparent-huge-page mappings where Linux allows: the
    first touch of 4 KiB pages, not the disk, is what limits loading a bank otherwise.
    """
    padded = align_up(nbytes)
    if padded >= HUGE_PAGE and _MADV_HUGEPAGE is not None:
        return _huge_page_buffer(padded, _MADV_HUGEPAGE)
    raw = torch.empty(padded + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + padded]


def _huge_page_buffer(padded: int, advice: int) -> torch.Tensor:
    # private (not shared: that would be shmem) anonymous memory, 2 MiB-aligned inside
    m = mmap.mmap(-1, padded + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(advice)
    except OSError:
        pass  # kernel without THP: 4 KiB pages, slower first touch, same result
    raw = torch.frombuffer(m, dtype=torch.uint8)  # holds the buffer: unmapped when freed
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip : skip + padded]


def writable_view(buf: torch.Tensor) -> memoryview:
    """A memoryview over a contiguous uint8 CPU tensor's bytes, without copying."""
    return buf.numpy().data


def default_num_threads() -> int:
    # Reads block in the kernel (GIL released): more threads than cores keeps the SSD's
    # queue full with O_DIRECT, and page-cache copies scale with cores.
    return min(32, max(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class ReadRequest:
    """Read ``path`` from ``offset`` into ``buffers`` in order (one scatter read)."""

    path: Path
    offset: int
    buffers: tuple[memoryview, ...]
    tag: Any = None  # the caller's bookkeeping, handed back to ``after_read``

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


class _Source:
    """One file opened twice: O_DIRECT (while the filesystem accepts it) and plain."""

    def __init__(self, path: Path, direct: bool) -> None:
        self.path = path
        try:
            self.plain_fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ModelFormatError(f"{path} is missing; re-run `moed convert`") from None
        self.direct_fd: int | None = None
        self._direct_fds: list[int] = []
        if direct and _O_DIRECT:
            try:
                fd = os.open(path, os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    os.close(self.plain_fd)
                    raise
            else:
                self.direct_fd = fd
                self._direct_fds.append(fd)

    def read(self, offset: int, buffers: Sequence[memoryview]) -> None:
        fd = self.direct_fd
        if fd is not None:
            try:
                _preadv_all(fd, self.path, offset, buffers)
                return
            except OSError as e:
                # tmpfs, some network and FUSE filesystems refuse O_DIRECT only when reading
                if e.errno != errno.EINVAL:
                    raise
                self.direct_fd = None
        _preadv_all(self.plain_fd, self.path, offset, buffers)

    def close(self) -> None:
        for fd in [self.plain_fd, *self._direct_fds]:
            os.close(fd)


def _preadv_all(fd: int, path: Path, offset: int, buffers: Sequence[memoryview]) -> None:
    """Fill every buffer, looping over short reads; running out of file is a truncation."""
    bufs = [b for b in buffers if b.nbytes]
    need = sum(b.nbytes for b in bufs)
    start = offset
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n == 0:
            raise ModelFormatError(
                f"{path} ends at byte {offset}, but {need} bytes from byte {start} were expected: "
                f"the file is truncated; re-run `moed convert`"
            )
        offset += n
        while n:
            if n >= bufs[0].nbytes:
                n -= bufs[0].nbytes
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0


def read_parallel(
    requests: Sequence[ReadRequest],
    *,
    num_threads: int | None = None,
    direct: bool = True,
    after_read: Callable[[ReadRequest], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Run every request on a thread pool; the first failure cancels the rest and is raised.

    ``after_read`` runs on the worker thread right after its request (data still in cache);
    ``progress(done_bytes, total_bytes)`` runs on the calling thread.
    """
    total = sum(r.nbytes for r in requests)
    sources: dict[Path, _Source] = {}
    lock = threading.Lock()

    def source(path: Path) -> _Source:
        with lock:
            if path not in sources:
                sources[path] = _Source(path, direct)
            return sources[path]

    def run(req: ReadRequest) -> int:
        src = source(req.path)
        try:
            src.read(req.offset, req.buffers)
        except OSError as e:
            raise ModelFormatError(f"{req.path}: read at byte {req.offset} failed: {e}") from e
        if after_read is not None:
            after_read(req)
        return req.nbytes

    pool = ThreadPoolExecutor(max_workers=max(1, num_threads or default_num_threads()))
    try:
        pending: set[Future[int]] = {pool.submit(run, r) for r in requests}
        done_bytes = 0
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for fut in done:
                done_bytes += fut.result()  # re-raises the worker's exception
                if progress is not None:
                    progress(done_bytes, total)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for src in sources.values():
            src.close()
