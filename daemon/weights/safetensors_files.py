"""The *.safetensors files of a model directory, read tensor by tensor with pread (no mmap).

safetensors' own reader maps whole files: every page a conversion touches then counts in the
process's RSS until the mapping goes, so converting a 60 GB checkpoint looks like (and, under
memory pressure, behaves like) holding 60 GB. Here each tensor is read into a buffer of its own
and the file pages stay in the page cache, where the kernel can drop them.

Format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets are relative to 8 + N.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moed.errors import ModelFormatError, quoted
from moed.weights.direct_io import writable_view
from moed.weights.file_checks import require_regular_file

MAX_HEADER_BYTES = 100 << 20  # safetensors itself refuses headers above 100 MB
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # power-of-two block scales (DeepSeek-V4's ue8m0 FP8 / FP4 scales)
}
CORRUPT = "the file is corrupt or truncated"


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFiles:
    """Every tensor of a directory's *.safetensors files, by name; headers are parsed up front."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise ModelFormatError(f"{path}: no *.safetensors weight files found")
        for file in self.files:
            require_regular_file(file)
        self.entries: dict[str, TensorEntry] = {}
        for file in self.files:
            for name, entry in _read_header(file).items():
                if name in self.entries:
                    raise ModelFormatError(f"{file}: tensor {quoted(name)} is also in {self.entries[name].file.name}")
                self.entries[name] = entry

    def keys(self) -> list[str]:
        return list(self.entries)

    def rename(self, new_name: Callable[[str], str]) -> None:
        """Re-key every tensor as ``new_name(name)``: a checkpoint published under other names than the ones moed
        reads (DeepSeek-V4's ``embed.weight``, ``layers.{i}.…``); errors then quote the new names, with the file."""
        renamed: dict[str, TensorEntry] = {}
        for name, entry in self.entries.items():
            key = new_name(name)
            if key in renamed:
                raise ModelFormatError(f"{entry.file}: tensors {quoted(name)} and another both read as {quoted(key)}; "
                                       "the checkpoint mixes two naming layouts")
            renamed[key] = entry
        self.entries = renamed

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    @property
    def location(self) -> dict[str, Path]:
        return {name: e.file for name, e in self.entries.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def get(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The tensor, read now into memory of its own (as ``dtype``; None keeps the stored dtype)."""
        entry = self._entry(name)
        raw = torch.empty(entry.size, dtype=torch.uint8)  # torch's allocator: huge pages (see gguf_file.py)
        buf = writable_view(raw)
        try:
            with open(entry.file, "rb", buffering=0) as f:
                got = os.preadv(f.fileno(), [buf], entry.offset) if entry.size else 0
        except OSError as exc:
            raise ModelFormatError(f"{entry.file}: cannot read tensor {quoted(name)} ({exc.strerror}); {CORRUPT}") from None
        if got != entry.size:
            raise ModelFormatError(f"{entry.file}: tensor {quoted(name)} is cut short ({got} of {entry.size} bytes); {CORRUPT}")
        if entry.size:
            tensor = raw.view(entry.dtype).reshape(entry.shape)
        else:
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
        if dtype is not None and tensor.dtype != dtype:
            return tensor.to(dtype)
        return tensor

    def _entry(self, name: str) -> TensorEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise ModelFormatError(f"tensor {quoted(name)} not found in any *.safetensors file of {self.path}")
        return entry


def _read_header(file: Path) -> dict[str, TensorEntry]:
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ModelFormatError(f"{file}: {len(head)} bytes, too short for a safetensors header; {CORRUPT}")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise ModelFormatError(f"{file}: header length {length} does not fit the file ({size} bytes); {CORRUPT}")
            raw = f.read(length)
    except OSError as exc:
        raise ModelFormatError(f"{file}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{file}: the header is not valid JSON ({exc}); {CORRUPT}") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{file}: the header is not a JSON object; {CORRUPT}")
    base = 8 + length
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(file, name, meta, base, size)
    return entries


def _entry(file: Path, name: str, meta: object, base: int, file_size: int) -> TensorEntry:
    where = f"{file}: tensor {quoted(name)}"
    if not isinstance(meta, dict):
        raise ModelFormatError(f"{where}: header entry is not an object; {CORRUPT}")
    dtype = DTYPES.get(meta.get("dtype"))
    if dtype is None:
        raise ModelFormatError(f"{where}: dtype {quoted(meta.get('dtype'))} is not supported "
                               f"(supported: {', '.join(DTYPES)})")
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise ModelFormatError(f"{where}: bad shape or data_offsets; {CORRUPT}")
    begin, end = offsets
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end or end - begin != nbytes:
        raise ModelFormatError(f"{where}: data_offsets {offsets} do not hold shape {shape} of {meta['dtype']}; {CORRUPT}")
    if base + end > file_size:
        raise ModelFormatError(f"{where}: its data ends at byte {base + end} but the file has {file_size}; {CORRUPT}")
    return TensorEntry(file, dtype, tuple(shape), base + begin, nbytes)
