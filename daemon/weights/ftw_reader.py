"""Read an FTW directory: validate the index, then load tensors straight into aligned host buffers."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from moed.errors import ModelFormatError
from moed.weights.direct_io import (
    ALIGN,
    DEFAULT_CHUNK,
    MAX_IOV,
    ReadRequest,
    aligned_empty,
    read_parallel,
    writable_view,
)
from moed.weights.ftw_format import (
    ALIGNMENT,
    INDEX_NAME,
    REBUILD_HINT,
    FtwIndex,
    FtwTensor,
    align_up,
    crc32_combine,
    index_from_json,
)

# shard padding makes every tensor's padded length readable, which is what O_DIRECT needs
assert ALIGN == ALIGNMENT


def _root(path: str | Path) -> Path:
    p = Path(path)
    if p.name == INDEX_NAME and p.is_file():
        return p.parent
    if not p.exists():
        raise ModelFormatError(f"{p} does not exist; convert a checkpoint with `moed convert` first")
    if not p.is_dir():
        raise ModelFormatError(f"{p} is not a directory; expected a model directory made by `moed convert`")
    return p


def read_ftw_index(path: str | Path) -> FtwIndex:
    """Parse and validate ``ftw.json``, and check every shard and extra file is whole."""
    root = _root(path)
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        raise ModelFormatError(
            f"{root} has no {INDEX_NAME}: it is not a converted moed model, or its conversion "
            f"did not finish; re-run `moed convert`"
        )
    index = index_from_json(index_path.read_bytes(), index_path)
    for name, size in [(f.name, f.size) for f in index.files.values()] + [
        (e.name, e.size) for e in index.extra_files.values()
    ]:
        _check_size(root / name, size)
    return index


def _check_size(p: Path, expected: int) -> None:
    try:
        actual = p.stat().st_size
    except FileNotFoundError:
        raise ModelFormatError(f"{p} is missing (listed in {INDEX_NAME}); {REBUILD_HINT}") from None
    if actual != expected:
        what = "truncated" if actual < expected else "longer than recorded"
        raise ModelFormatError(
            f"{p} is {actual} bytes but {INDEX_NAME} records {expected}: the file is {what}; {REBUILD_HINT}"
        )


def extra_file_path(path: str | Path, name: str) -> Path:
    """Path of a file copied verbatim at conversion (config.json, tokenizer.json, ...)."""
    root = _root(path)
    index = read_ftw_index(root)
    if name not in index.extra_files:
        have = ", ".join(sorted(index.extra_files)) or "none"
        raise ModelFormatError(f"{root / INDEX_NAME} lists no extra file {name!r} (it has: {have}); {REBUILD_HINT}")
    return root / name


def load_ftw(
    path: str | Path,
    *,
    verify: bool = False,
    names: Iterable[str] | None = None,
    num_threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    direct: bool = True,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[FtwIndex, dict[str, torch.Tensor]]:
    """Load tensors (all, or ``names``) in index order, each in its own 4096-aligned buffer.

    Big tensors are read in ``chunk_size`` pieces and runs of small adjacent ones in one
    scatter read, on ``num_threads`` threads, with O_DIRECT unless ``direct`` is False or
    the filesystem refuses it. ``verify`` checks every tensor's and extra file's crc32.
    ``progress(done_bytes, total_bytes)`` is called on the calling thread.
    """
    root = _root(path)
    index = read_ftw_index(root)
    selected = _select(index, names, root)
    out: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for t in selected:
        if t.size == 0:
            out[t.name] = torch.empty(t.shape, dtype=t.torch_dtype)
            continue
        buf = aligned_empty(t.size)
        buffers[t.name] = buf
        out[t.name] = buf[: t.size].view(t.torch_dtype).view(t.shape)

    requests = _plan_reads(root, [t for t in selected if t.size], buffers, align_up(max(chunk_size, ALIGN)))
    pieces: dict[str, dict[int, tuple[int, int]]] = {t.name: {} for t in selected}

    def checksum(req: ReadRequest) -> None:
        for buf, (name, start, valid) in zip(req.buffers, req.tag):
            pieces[name][start] = (zlib.crc32(buf[:valid]), valid)  # zlib drops the GIL

    read_parallel(
        requests,
        num_threads=num_threads,
        direct=direct,
        after_read=checksum if verify else None,
        progress=progress,
    )
    if verify:
        for t in selected:
            _check_crc(root, t, pieces[t.name])
        for e in index.extra_files.values():
            crc = zlib.crc32((root / e.name).read_bytes())
            if crc != e.crc32:
                raise ModelFormatError(
                    f"{root / e.name}: checksum mismatch (crc32 {crc:#010x}, {INDEX_NAME} records "
                    f"{e.crc32:#010x}): the file is corrupt or was edited; {REBUILD_HINT}"
                )
    return index, out


def _select(index: FtwIndex, names: Iterable[str] | None, root: Path) -> list[FtwTensor]:
    if names is None:
        return list(index.tensors.values())
    wanted = set(names)
    missing = sorted(wanted - index.tensors.keys())
    if missing:
        raise ModelFormatError(f"{root / INDEX_NAME} has no tensor {missing[0]!r}; {REBUILD_HINT}")
    return [t for t in index.tensors.values() if t.name in wanted]


def _plan_reads(
    root: Path, tensors: list[FtwTensor], buffers: dict[str, torch.Tensor], chunk: int
) -> list[ReadRequest]:
    """Split big tensors into aligned chunks; merge file-adjacent small ones into scatter reads.

    Each buffer comes tagged ``(tensor name, byte offset in tensor, bytes that are data)``;
    the rest of the buffer is shard padding read only to keep O_DIRECT lengths aligned.
    """
    by_file: dict[str, list[FtwTensor]] = {}
    for t in tensors:
        by_file.setdefault(t.file, []).append(t)
    requests: list[ReadRequest] = []
    for file, group in by_file.items():
        requests += _plan_file_reads(root / file, sorted(group, key=lambda t: t.offset), buffers, chunk)
    return requests


def _plan_file_reads(
    path: Path, group: list[FtwTensor], buffers: dict[str, torch.Tensor], chunk: int
) -> list[ReadRequest]:
    requests: list[ReadRequest] = []
    run: list[tuple[memoryview, tuple[str, int, int]]] = []  # the scatter read being built
    run_start = run_end = 0
    for t in group:
        mv = writable_view(buffers[t.name])
        joins = run and t.offset == run_end and run_end - run_start + t.padded_size <= chunk and len(run) < MAX_IOV
        if run and (t.padded_size > chunk or not joins):
            requests.append(_scatter(path, run_start, run))
            run = []
        if t.padded_size > chunk:
            for start in range(0, t.padded_size, chunk):
                n = min(chunk, t.padded_size - start)
                tag = (t.name, start, min(n, t.size - start))
                requests.append(ReadRequest(path, t.offset + start, (mv[start : start + n],), (tag,)))
            continue
        if not run:
            run_start = t.offset
        run.append((mv, (t.name, 0, t.size)))
        run_end = t.offset + t.padded_size
    if run:
        requests.append(_scatter(path, run_start, run))
    return requests


def _scatter(path: Path, offset: int, run: list[tuple[memoryview, tuple[str, int, int]]]) -> ReadRequest:
    return ReadRequest(path, offset, tuple(b for b, _ in run), tuple(tag for _, tag in run))


def _check_crc(root: Path, t: FtwTensor, pieces: dict[int, tuple[int, int]]) -> None:
    crc = 0
    for start in sorted(pieces):
        piece_crc, length = pieces[start]
        crc = crc32_combine(crc, piece_crc, length) if start else piece_crc
    if crc != t.crc32:
        raise ModelFormatError(
            f"{root / t.file}: tensor {t.name!r} (bytes {t.offset}..{t.offset + t.size}) fails its "
            f"checksum (crc32 {crc:#010x}, {INDEX_NAME} records {t.crc32:#010x}): the file is corrupt; "
            f"{REBUILD_HINT}"
        )
