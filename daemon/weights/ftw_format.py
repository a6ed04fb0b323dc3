"""The FTW ("flat tensor weights") container: constants, index dataclasses, JSON (de)serialisation."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moed.errors import ModelFormatError

FORMAT_NAME = "moed-ftw"
FORMAT_VERSION = 1
ALIGNMENT = 4096  # O_DIRECT needs offsets, lengths and buffers aligned to the block size
INDEX_NAME = "ftw.json"
CHECKSUM = "crc32"
DEFAULT_SHARD_SIZE = 4 << 30
KINDS = ("weight", "expert_bank")
REBUILD_HINT = "re-run `moed convert` to rebuild it"

# name in the index -> torch dtype; byte order is the host's (little-endian on every target)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.bin"


def is_plain_file_name(name: object) -> bool:
    """A name that stays inside the model directory and cannot hide (no '/', no leading '.')."""
    return (
        isinstance(name, str)
        and bool(name)
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


@dataclass(frozen=True)
class FtwTensor:
    """Where one tensor lives: ``size`` exact bytes at an aligned ``offset`` of ``file``."""

    name: str
    kind: str  # one of KINDS
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    file: str
    offset: int
    size: int
    crc32: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def padded_size(self) -> int:
        """Bytes covered on disk: shards are zero-padded so this many bytes can always be read."""
        return align_up(self.size)


@dataclass(frozen=True)
class FtwFile:
    """A shard file and its exact size (a multiple of ALIGNMENT)."""

    name: str
    size: int


@dataclass(frozen=True)
class FtwExtraFile:
    """A file copied verbatim from the source (config.json, tokenizer.json, ...)."""

    name: str
    size: int
    crc32: int


@dataclass(frozen=True)
class FtwIndex:
    """The parsed ``ftw.json``: tensors, shard files, extra files and caller metadata."""

    source_fingerprint: str
    metadata: dict[str, Any]
    files: dict[str, FtwFile]
    tensors: dict[str, FtwTensor]
    extra_files: dict[str, FtwExtraFile] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    alignment: int = ALIGNMENT
    checksum: str = CHECKSUM

    def nbytes(self) -> int:
        return sum(t.size for t in self.tensors.values())


def index_to_json(index: FtwIndex) -> str:
    """Pretty header, then one line per file and per tensor (greppable, still small)."""
    head = {
        "format": FORMAT_NAME,
        "version": index.version,
        "alignment": index.alignment,
        "source_fingerprint": index.source_fingerprint,
        "checksum": index.checksum,
        "metadata": index.metadata,
    }
    tables: dict[str, dict[str, Any]] = {
        "files": {f.name: {"size": f.size} for f in index.files.values()},
        "extra_files": {e.name: {"size": e.size, "crc32": e.crc32} for e in index.extra_files.values()},
        "tensors": {
            t.name: {
                "kind": t.kind,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "file": t.file,
                "offset": t.offset,
                "size": t.size,
                "crc32": t.crc32,
            }
            for t in index.tensors.values()
        },
    }
    parts = [json.dumps(head, indent=1, allow_nan=False)[:-2]]
    for key, table in tables.items():
        rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items())
        parts.append(f' {json.dumps(key)}: {{\n{rows}\n }}' if rows else f' {json.dumps(key)}: {{}}')
    return ",\n".join(parts) + "\n}\n"


class _Checker:
    """Raises ModelFormatError naming the index file and saying how to fix it."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.where}: {what}; the model directory is corrupt, {REBUILD_HINT}")

    def get(self, obj: dict[str, Any], key: str, typ: type | tuple[type, ...], ctx: str) -> Any:
        if key not in obj:
            raise self.fail(f"{ctx} has no {key!r} field")
        value = obj[key]
        # bool is an int subclass; a JSON true is never a valid size or offset
        if not isinstance(value, typ) or (isinstance(value, bool) and bool not in _as_tuple(typ)):
            raise self.fail(f"{ctx} field {key!r} is {value!r}, expected {_type_names(typ)}")
        return value

    def nonneg_int(self, obj: dict[str, Any], key: str, ctx: str) -> int:
        value: int = self.get(obj, key, int, ctx)
        if value < 0:
            raise self.fail(f"{ctx} field {key!r} is negative ({value})")
        return value


def _as_tuple(typ: type | tuple[type, ...]) -> tuple[type, ...]:
    return typ if isinstance(typ, tuple) else (typ,)


def _type_names(typ: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(typ))


def index_from_json(text: str | bytes, where: Path) -> FtwIndex:
    """Parse and validate an index; ``where`` (the ftw.json path) names the file in errors.

    Checks everything that needs no disk access: format, version, alignment, every tensor's
    fields, sizes against dtype and shape, alignment of offsets, extents within the recorded
    shard sizes, and that no two tensors overlap.
    """
    c = _Checker(where)
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise c.fail(f"is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise c.fail("is not a JSON object")
    fmt = doc.get("format")
    if fmt != FORMAT_NAME:
        raise ModelFormatError(
            f"{where}: format is {fmt!r}, not {FORMAT_NAME!r}: this is not a moed weight index; "
            f"point moed at a directory made by `moed convert`"
        )
    version = c.get(doc, "version", int, "the index")
    if version > FORMAT_VERSION:
        raise ModelFormatError(
            f"{where}: written by a newer moed (format version {version}, this moed reads "
            f"version {FORMAT_VERSION}); upgrade moed or {REBUILD_HINT} with this version"
        )
    if version != FORMAT_VERSION:
        raise c.fail(f"has unsupported format version {version}")
    alignment = c.get(doc, "alignment", int, "the index")
    if alignment != ALIGNMENT:
        raise c.fail(f"has alignment {alignment}, expected {ALIGNMENT}")
    checksum = c.get(doc, "checksum", str, "the index")
    if checksum != CHECKSUM:
        raise c.fail(f"uses checksum {checksum!r}, expected {CHECKSUM!r}")
    fingerprint = c.get(doc, "source_fingerprint", str, "the index")
    metadata = c.get(doc, "metadata", dict, "the index")

    files: dict[str, FtwFile] = {}
    for name, entry in c.get(doc, "files", dict, "the index").items():
        ctx = f"file {name!r}"
        if not is_plain_file_name(name) or name == INDEX_NAME:
            raise c.fail(f"{ctx} is not a plain file name")
        if not isinstance(entry, dict):
            raise c.fail(f"{ctx} entry is not an object")
        size = c.nonneg_int(entry, "size", ctx)
        if size % ALIGNMENT:
            raise c.fail(f"{ctx} has size {size}, not a multiple of {ALIGNMENT}")
        files[name] = FtwFile(name, size)

    extra: dict[str, FtwExtraFile] = {}
    extra_doc: dict[str, Any] = c.get(doc, "extra_files", dict, "the index") if "extra_files" in doc else {}
    for name, entry in extra_doc.items():
        ctx = f"extra file {name!r}"
        if not is_plain_file_name(name) or name == INDEX_NAME or name in files:
            raise c.fail(f"{ctx} is not a plain file name distinct from the shards")
        if not isinstance(entry, dict):
            raise c.fail(f"{ctx} entry is not an object")
        extra[name] = FtwExtraFile(name, c.nonneg_int(entry, "size", ctx), _crc(c, entry, ctx))

    tensors: dict[str, FtwTensor] = {}
    for name, entry in c.get(doc, "tensors", dict, "the index").items():
        tensors[name] = _tensor_from_json(c, name, entry, files)
    _check_no_overlap(c, tensors.values())
    return FtwIndex(fingerprint, metadata, files, tensors, extra, version, alignment, checksum)


def _crc(c: _Checker, entry: dict[str, Any], ctx: str) -> int:
    value = c.nonneg_int(entry, "crc32", ctx)
    if value >= 1 << 32:
        raise c.fail(f"{ctx} field 'crc32' is {value}, not a 32-bit value")
    return value


def _tensor_from_json(c: _Checker, name: str, entry: Any, files: dict[str, FtwFile]) -> FtwTensor:
    ctx = f"tensor {name!r}"
    if not name:
        raise c.fail("a tensor has an empty name")
    if not isinstance(entry, dict):
        raise c.fail(f"{ctx} entry is not an object")
    kind = c.get(entry, "kind", str, ctx)
    if kind not in KINDS:
        raise c.fail(f"{ctx} has kind {kind!r}, expected one of {KINDS}")
    dtype = c.get(entry, "dtype", str, ctx)
    if dtype not in DTYPES:
        raise c.fail(f"{ctx} has unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    shape_list = c.get(entry, "shape", list, ctx)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape_list):
        raise c.fail(f"{ctx} has shape {shape_list!r}, expected a list of non-negative integers")
    shape = tuple(shape_list)
    file = c.get(entry, "file", str, ctx)
    if file not in files:
        raise c.fail(f"{ctx} lives in {file!r}, which is not listed under 'files'")
    offset = c.nonneg_int(entry, "offset", ctx)
    if offset % ALIGNMENT:
        raise c.fail(f"{ctx} has offset {offset}, not a multiple of {ALIGNMENT}")
    size = c.nonneg_int(entry, "size", ctx)
    itemsize = DTYPES[dtype].itemsize
    expected = math.prod(shape) * itemsize
    if size != expected:
        raise c.fail(f"{ctx} has size {size} bytes, but {dtype} {list(shape)} takes {expected}")
    end = offset + align_up(size)
    if end > files[file].size:
        raise c.fail(
            f"{ctx} spans bytes {offset}..{end} of {file!r}, beyond its recorded size {files[file].size}"
        )
    return FtwTensor(name, kind, dtype, shape, file, offset, size, _crc(c, entry, ctx))


def _check_no_overlap(c: _Checker, tensors: Iterable[FtwTensor]) -> None:
    by_file: dict[str, list[FtwTensor]] = {}
    for t in tensors:
        if t.size:
            by_file.setdefault(t.file, []).append(t)
    for group in by_file.values():
        group.sort(key=lambda t: t.offset)
        for a, b in zip(group, group[1:]):
            if a.offset + a.size > b.offset:
                raise c.fail(f"tensors {a.name!r} and {b.name!r} overlap in {a.file!r}")


_FINGERPRINT_SAMPLE = 1 << 20


def source_fingerprint_of(paths: list[Path]) -> str:
    """Identify a source checkpoint cheaply, without reading all of it.

    ``"sha256:" + hex`` of, for each file in order of (base name, full path): its base name,
    its size, its first 1 MiB and its last 1 MiB. Renaming the source directory keeps the
    fingerprint; editing, truncating or replacing a file changes it (unless the edit is
    confined to the middle of a file bigger than 2 MiB and keeps its size).
    """
    h = hashlib.sha256()
    for p in sorted((Path(p) for p in paths), key=lambda p: (p.name, str(p))):
        size = p.stat().st_size
        h.update(p.name.encode() + b"\0" + str(size).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read(_FINGERPRINT_SAMPLE))
            if size > _FINGERPRINT_SAMPLE:
                f.seek(max(_FINGERPRINT_SAMPLE, size - _FINGERPRINT_SAMPLE), os.SEEK_SET)
                h.update(f.read(_FINGERPRINT_SAMPLE))
    return "sha256:" + h.hexdigest()


# crc32_combine (zlib's algorithm, in pure Python): lets the reader checksum chunks on the
# threads that read them and still check one crc32 per tensor.
_CRC_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(31):
        p = _multmodp(p, p)
        table.append(p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) from crc32(A), crc32(B) and len(B)."""
    p = 1 << 31  # x^0
    n, k = len2, 3  # x^(8 * len2)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2
