"""One GGUF file (llama.cpp's single-file model format): metadata as plain Python values, tensor bytes read with pread.

The container is parsed by ``gguf.GGUFReader`` (llama.cpp's own gguf-py) for the metadata and the
tensor infos only. That reader memory-maps the file; nothing here touches tensor data through the
map (it is dropped once the header is parsed). Tensor bytes are read with ``os.preadv`` into
buffers of their own, as safetensors_files.py does, so a 60 GB file's pages stay in the page cache
and never count in our RSS; an expert tensor can be read a slice of experts at a time.

Layout: ``GGUF`` magic, version (u32), tensor count and metadata count (u64), the metadata
key/values, the tensor infos (name, dims ``ne`` innermost first, ggml type, offset), padding to
``general.alignment`` (default 32), then the tensor data. Shapes here are in numpy order
(``ne`` reversed): a GGUF ``[n_embd, n_ff, n_expert]`` expert tensor is ``(E, I, D)``.

A model split by llama.cpp's gguf-split (``name-00001-of-00003.gguf`` ..., ``split.count`` in
each part's metadata, the model's metadata in the first) is opened from its first part as one
file: the tensors of every part, each read from the part that holds it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from moed.errors import ModelFormatError, quoted
from moed.weights.direct_io import writable_view
from moed.weights.file_checks import require_regular_file
from moed.kernels.gguf_quants import MOED_TYPES, UnsupportedGgufType, nbytes, type_name

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DOWNLOAD_AGAIN = "the file is corrupt or truncated; download it again"
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's llama_split_path


@dataclass(frozen=True)
class GgufTensor:
    """Where one tensor's data lies in the file."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy order (GGUF ne reversed)
    offset: int  # absolute byte offset in ``file``
    nbytes: int
    file: Path  # the file (the part of a split model) that holds it
    # a part of a stored tensor (GgufFile.split_rows): each entry of the leading dimension is ``nbytes / shape[0]``
    # bytes at ``offset + entry * stride``; 0 for a tensor stored whole
    stride: int = 0

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def is_gguf_file(path: str | Path) -> bool:
    """A regular file (or a symlink to one) that starts with the GGUF magic; never opens a FIFO."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


class GgufFile:
    """A GGUF file's header (every part's, for a split model), parsed up front; tensor data read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.version, self.metadata, self.tensors = _read_part(self.path)
        self.files = [self.path]
        count, number = self.metadata.get("split.count", 1), self.metadata.get("split.no", 0)
        if isinstance(count, int) and isinstance(number, int) and count > 1:
            self._add_split_parts(count, number)

    def _add_split_parts(self, count: int, number: int) -> None:
        match = SPLIT_NAME.match(self.path.name)
        if number != 0 or match is None or int(match["count"]) != count:
            first = f"{match['prefix']}-00001-of-{count:05d}.gguf" if match else f"*-00001-of-{count:05d}.gguf"
            raise ModelFormatError(f"{self.path}: part {number + 1} of a GGUF split into {count} files; point --model at "
                                   f"the first part ({first}), with every part in the same directory")
        for index in range(1, count):
            part = self.path.with_name(f"{match['prefix']}-{index + 1:05d}-of-{count:05d}.gguf")
            if not part.exists():
                raise ModelFormatError(f"{part}: part {index + 1} of {count} of {self.path.name} is missing; download "
                                       "every part into the same directory")
            _, metadata, tensors = _read_part(part)
            if metadata.get("split.no") != index or metadata.get("split.count") != count:
                raise ModelFormatError(f"{part}: not part {index + 1} of {count} of {self.path.name} (its split metadata "
                                       "says otherwise); download the parts of one model again")
            for name, info in tensors.items():
                if name in self.tensors:
                    raise ModelFormatError(f"{part}: tensor {quoted(name)} is also in {self.tensors[name].file.name}; "
                                           "the parts belong to different models")
                self.tensors[name] = info
            self.files.append(part)
        expected = self.metadata.get("split.tensors.count")
        if isinstance(expected, int) and expected != len(self.tensors):
            raise ModelFormatError(f"{self.path}: the {count} parts hold {len(self.tensors)} tensors but the first says "
                                   f"{expected}; download the parts again")

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> GgufTensor:
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path}: tensor {quoted(name)} is missing; the file is incomplete or "
                                   "not a model moed can read")
        return info

    def split_rows(self, name: str, parts: dict[str, tuple[int, int]]) -> None:
        """Expose rows ``r0 .. r1`` of the second dimension of the 3-D tensor ``name``, in every entry of its first, as
        tensors of their own (``parts``: new name -> (r0, r1)); they read as stored tensors do, an entry at a time.
        Gemma-4's experts are one fused ``ffn_gate_up_exps [E, 2I, D]`` that moed reads as gate and up."""
        info = self.tensor(name)
        if len(info.shape) != 3 or info.stride:
            raise ModelFormatError(f"{self.path}: tensor {quoted(name)} of shape {list(info.shape)} is not a stored 3-D "
                                   "tensor; the file is not what its architecture writes")
        lead, rows = info.shape[0], info.shape[1]
        entry = info.nbytes // lead
        for part, (r0, r1) in parts.items():
            if not 0 <= r0 < r1 <= rows or part in self.tensors:
                raise ModelFormatError(f"{self.path}: rows {r0}..{r1} of tensor {quoted(name)} ({rows} rows) cannot be "
                                       f"read as {quoted(part)}; the file is corrupt")
            per_row = entry // rows
            self.tensors[part] = dataclasses.replace(info, name=part, shape=(lead, r1 - r0, *info.shape[2:]),
                                                     offset=info.offset + r0 * per_row,
                                                     nbytes=lead * (r1 - r0) * per_row, stride=entry)

    def read(self, name: str, rows: tuple[int, int] | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's raw bytes, ``uint8 [nbytes]``, read now into memory of its own (or into ``out``,
        a contiguous uint8 tensor of exactly that many bytes, returned flat).

        ``rows=(r0, r1)`` reads only entries ``r0 .. r1`` of the leading (slowest) dimension, e.g.
        experts ``e0 .. e1`` of an expert tensor, without touching the rest of the file.
        """
        info = self.tensor(name)
        if info.stride:
            return self._read_strided(info, rows, out)
        offset, size = info.offset, info.nbytes
        if rows is not None:
            r0, r1 = rows
            lead = info.shape[0] if info.shape else 1
            if not 0 <= r0 <= r1 <= lead:
                raise ValueError(f"{self.path}: rows {rows} out of range for tensor {name!r} of shape {info.shape}")
            per_row = info.nbytes // lead if lead else 0
            offset, size = info.offset + r0 * per_row, (r1 - r0) * per_row
        if out is not None:
            if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != size or out.device.type != "cpu":
                raise ValueError(f"read {name!r}: out must be a contiguous host uint8 tensor of {size} bytes")
            out = out.view(-1)
        if size == 0:
            return torch.empty(0, dtype=torch.uint8) if out is None else out
        # torch's allocator, not a bytearray: it puts 2 MiB+ buffers on huge pages (moed/__init__.py),
        # and decode streams these weights every token (measured ~33 -> ~50 GB/s for a bf16 GEMV)
        out = torch.empty(size, dtype=torch.uint8) if out is None else out
        self._pread(info, out, offset, size)
        return out

    def _read_strided(self, info: GgufTensor, rows: tuple[int, int] | None,
                      out: torch.Tensor | None) -> torch.Tensor:
        """A tensor of split_rows: entries ``rows`` (all by default), each one read from its own place."""
        lead = info.shape[0]
        r0, r1 = rows if rows is not None else (0, lead)
        if not 0 <= r0 <= r1 <= lead:
            raise ValueError(f"{self.path}: rows {rows} out of range for tensor {info.name!r} of shape {info.shape}")
        entry = info.nbytes // lead
        size = (r1 - r0) * entry
        if out is not None and (out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != size
                                or out.device.type != "cpu"):
            raise ValueError(f"read {info.name!r}: out must be a contiguous host uint8 tensor of {size} bytes")
        out = torch.empty(size, dtype=torch.uint8) if out is None else out.view(-1)
        for e in range(r0, r1):
            self._pread(info, out[(e - r0) * entry:(e - r0 + 1) * entry], info.offset + e * info.stride, entry)
        return out

    def _pread(self, info: GgufTensor, out: torch.Tensor, offset: int, size: int) -> None:
        name = info.name
        if size == 0:
            return
        buf = writable_view(out)
        got = 0
        try:
            with open(info.file, "rb", buffering=0) as f:
                while got < size:  # a read returns at most ~2 GiB: a whole expert tensor can be more
                    n = os.preadv(f.fileno(), [buf[got:]], offset + got)
                    if n <= 0:
                        break
                    got += n
        except OSError as exc:
            raise ModelFormatError(f"{info.file}: cannot read tensor {quoted(name)} ({exc.strerror}); "
                                   f"{DOWNLOAD_AGAIN}") from None
        if got != size:
            raise ModelFormatError(f"{info.file}: tensor {quoted(name)} is cut short ({got} of {size} bytes); "
                                   f"{DOWNLOAD_AGAIN}")


def _read_part(path: Path) -> tuple[int, dict[str, Any], dict[str, GgufTensor]]:
    """One file's version, metadata and tensor infos (extents checked against its size)."""
    require_regular_file(path)
    try:
        size = os.stat(path).st_size
        with open(path, "rb", buffering=0) as f:
            head = os.pread(f.fileno(), 8, 0)
    except OSError as exc:
        raise ModelFormatError(f"{path}: cannot read ({exc.strerror})") from None
    version = _check_head(path, head)
    reader = _parse_header(path)
    try:
        metadata = {name: _field_value(path, name, field) for name, field in reader.fields.items()
                    if not name.startswith("GGUF.")}
        tensors = _tensor_infos(path, reader)
    finally:
        del reader  # the memory map goes with it (fields are converted to Python values above)
    _check_extents(path, tensors, size)
    return version, metadata, tensors


def _check_head(path: Path, head: bytes) -> int:
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise ModelFormatError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes); "
                               "point --model at a .gguf file, a Hugging Face directory or an FTW directory")
    version = int.from_bytes(head[4:8], "little")
    if version not in SUPPORTED_VERSIONS and int.from_bytes(head[4:8], "big") in SUPPORTED_VERSIONS:
        raise ModelFormatError(f"{path}: a big-endian GGUF file; moed reads little-endian GGUF only (the usual "
                               "kind); download the little-endian file")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFormatError(f"{path}: GGUF version {version} is not supported (moed reads versions "
                               f"{', '.join(map(str, SUPPORTED_VERSIONS))}); re-convert it with a current llama.cpp")
    return version


# Bounds on what a header may ask the reader to build. gguf's reader makes one numpy view per array
# item and loops over counts read from the file, so a hostile count would cost memory and time
# without bound; real files stay far below these (a 262k-token vocabulary, ~1,100 tensors for
# DeepSeek-V3, a few dozen metadata keys).
MAX_METADATA_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
MAX_ARRAY_ITEMS = 1 << 22  # items in one metadata array
MAX_STRING_ITEMS = 1 << 23  # string items in all arrays together (each becomes two numpy views)
MAX_STRING_BYTES = 1 << 24  # one string (the longest real ones are chat templates of ~100 KB)
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, one byte of value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dims count, type, offset


class HeaderLimitError(ValueError):
    """A GGUF header asks for more items than any real file holds (or than the file has bytes for)."""


class _HeaderReader(gguf.GGUFReader):
    """GGUFReader stopped at the tensor infos, with every count bounded before it is looped over.

    The stock reader also builds a numpy view of every tensor's data, and fails with a bare reshape
    error when a truncated file cuts one short; here the infos are kept and the extents checked by
    ``_check_extents``, which names the tensor. Numeric metadata arrays are read as one view instead
    of a view per item (a 150k-entry score array is one slice, not 150k objects)."""

    _string_items = 0

    def _bounded(self, what: str, count: int, limit: int, offs: int, min_bytes: int) -> int:
        count, left = int(count), len(self.data) - offs
        if count > limit:
            raise HeaderLimitError(f"the header claims {count} {what}, more than moed reads (at most {limit})")
        if count * min_bytes > left:  # a truncated file, most likely: the generic "cut short" message
            raise ValueError(f"the header claims {count} {what}, more than the {left} bytes left can hold")
        return count

    def _get_str(self, offset: int):
        slen = self._get(offset, np.uint64)
        if len(slen) != 1:
            raise ValueError("a string is cut short")
        # the stock reader slices past the end without noticing: a hostile length would hand back the
        # rest of a many-GB file as one string
        self._bounded("bytes in a string", slen[0], MAX_STRING_BYTES, offset + 8, 1)
        return super()._get_str(offset)

    def _build_fields(self, offs: int, count: int) -> int:
        return super()._build_fields(offs, self._bounded("metadata keys", count, MAX_METADATA_KEYS, offs,
                                                         _MIN_KV_BYTES))

    def _build_tensor_info(self, offs: int, count: int):
        return super()._build_tensor_info(offs, self._bounded("tensors", count, MAX_TENSORS, offs,
                                                              _MIN_TENSOR_INFO_BYTES))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if len(raw_itype) != 1 or len(alen) != 1:
            raise ValueError("a metadata array is cut short")
        itype = gguf.GGUFValueType(int(raw_itype[0]))
        offs = orig_offs + 12
        if itype == gguf.GGUFValueType.ARRAY:
            raise HeaderLimitError("a metadata array holds arrays (no llama.cpp model writes nested arrays)")
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:  # numbers: one view of all items
            count = self._bounded("items in a metadata array", alen[0], MAX_ARRAY_ITEMS, offs,
                                  np.dtype(nptype).itemsize)
            items = self._get(offs, nptype, count)
            return 12 + int(items.nbytes), [raw_itype, alen, items], [2], [gguf.GGUFValueType.ARRAY, itype]
        count = self._bounded("items in a metadata array", alen[0], MAX_ARRAY_ITEMS, offs, 8)
        self._string_items += count
        if self._string_items > MAX_STRING_ITEMS:
            raise HeaderLimitError(f"the header's arrays hold more than {MAX_STRING_ITEMS} strings in all")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        self.tensor_data_start = start_offs
        self.tensor_fields = fields


def _parse_header(path: Path) -> _HeaderReader:
    try:
        return _HeaderReader(path, "r")
    except HeaderLimitError as exc:
        raise ModelFormatError(f"{path}: not a model file moed will read: {exc}; the file is corrupt or was not "
                               "written by llama.cpp") from None
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError, OSError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelFormatError(f"{path}: the GGUF header (metadata and tensor list) is cut short or corrupt; "
                               f"download it again (gguf reader: {quoted(detail, 120)})") from None


def _field_value(path: Path, name: str, field: Any) -> Any:
    """One metadata value as plain Python: str, int, float, bool, or a list of those."""
    types = [gguf.GGUFValueType(t) for t in field.types]
    try:
        if types[0] == gguf.GGUFValueType.ARRAY:
            if len(types) < 2:
                return []  # an empty array of strings: the reader records no item type
            if types[1] == gguf.GGUFValueType.STRING:
                return [_scalar(types[1], field.parts[i]) for i in field.data]
            return [_scalar(types[1], item) for item in field.parts[field.data[0]].reshape(-1, 1)]
        return _scalar(types[0], field.parts[field.data[0]])
    except UnicodeDecodeError:
        raise ModelFormatError(f"{path}: metadata {quoted(name)} holds a string that is not UTF-8; "
                               f"{DOWNLOAD_AGAIN}") from None


def _scalar(kind: Any, part: np.ndarray) -> Any:
    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    value = part[0]
    if kind == gguf.GGUFValueType.BOOL:
        return bool(value)
    if kind == gguf.GGUFValueType.FLOAT32:
        # the shortest decimal that is this float32: 1e-06 stays 1e-06, not 9.999999974752427e-07,
        # so a config written from a Hugging Face config.json compares equal to it
        return float(str(np.float32(value)))
    if kind == gguf.GGUFValueType.FLOAT64:
        return float(value)
    return int(value)


def _tensor_infos(path: Path, reader: _HeaderReader) -> dict[str, GgufTensor]:
    fields = getattr(reader, "tensor_fields", None)
    if fields is None:  # a gguf release that no longer calls _build_tensors: its own tensor list
        return {t.name: _tensor_info(path, t.name, int(t.tensor_type), t.shape.tolist(), int(t.data_offset), 0)
                for t in reader.tensors}
    tensors: dict[str, GgufTensor] = {}
    for field in fields:
        _name_len, name_data, _n_dims, dims, raw_type, offset = field.parts
        try:
            name = bytes(name_data).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(f"{path}: a tensor name is not UTF-8; {DOWNLOAD_AGAIN}") from None
        if name in tensors:
            raise ModelFormatError(f"{path}: tensor {quoted(name)} is listed twice; {DOWNLOAD_AGAIN}")
        tensors[name] = _tensor_info(path, name, int(raw_type[0]), dims.tolist(), int(offset[0]),
                                     int(reader.tensor_data_start))
    return tensors


def _tensor_info(path: Path, name: str, ggml_type: int, ne: list[int], offset: int, base: int) -> GgufTensor:
    shape = tuple(int(d) for d in reversed(ne))
    try:
        if ggml_type in MOED_TYPES:  # moed's own FP8 block ids: no GGUF file holds them
            raise UnsupportedGgufType(ggml_type)
        size = nbytes(ggml_type, shape)
    except UnsupportedGgufType:
        raise ModelFormatError(f"{path}: tensor {quoted(name)} has GGML type id {ggml_type}, which ggml does not "
                               "define; the file is corrupt, or newer than this moed (update moed)") from None
    except ValueError as exc:
        raise ModelFormatError(f"{path}: tensor {quoted(name)}: {exc}; {DOWNLOAD_AGAIN}") from None
    return GgufTensor(name, ggml_type, shape, base + offset, size, path)


def _check_extents(path: Path, tensors: dict[str, GgufTensor], file_size: int) -> None:
    """A download cut short leaves the header whole and the data short: name the first tensor past the end."""
    for info in sorted(tensors.values(), key=lambda t: t.offset):
        if info.end > file_size:
            raise ModelFormatError(f"{path} is truncated: tensor {quoted(info.name)} ends at byte {info.end} but the "
                                   f"file has {file_size}; download it again")
