"""SafetensorsFiles (pread, no mmap) against safetensors' own reader, and corrupt files as clear errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moed.errors import ModelFormatError
from moed.weights.safetensors_files import SafetensorsFiles


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 10, generator=g)
    return {"f32": x, "bf16": x.to(torch.bfloat16), "f16": x.to(torch.float16), "f8": x.to(torch.float8_e4m3fn),
            "i64": torch.arange(7), "u8": torch.randint(0, 255, (3, 5), generator=g, dtype=torch.uint8),
            "empty": torch.zeros(0, 4), "scalar": torch.tensor(3.5)}


def test_every_tensor_reads_back_as_safetensors_reads_it(tmp_path: Path) -> None:
    save_file(_tensors(), tmp_path / "a.safetensors")
    save_file({"other": torch.ones(2, 2)}, tmp_path / "b.safetensors")
    files = SafetensorsFiles(tmp_path)
    ref = {**load_file(tmp_path / "a.safetensors"), **load_file(tmp_path / "b.safetensors")}
    assert sorted(files.keys()) == sorted(ref)
    for name, want in ref.items():
        got = files.get(name, dtype=None)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        as_bytes = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731 - exact bytes (NaNs, fp8 included)
        assert torch.equal(as_bytes(got), as_bytes(want)), name
        assert files.shape(name) == tuple(want.shape) and files.dtype(name) == want.dtype
    assert torch.equal(files.get("bf16"), ref["bf16"].float())  # default: float32


def test_reading_does_not_map_the_file(tmp_path: Path) -> None:
    save_file({"w": torch.randn(256, 256)}, tmp_path / "m.safetensors")
    files = SafetensorsFiles(tmp_path)
    files.get("w")
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(tmp_path / "m.safetensors") not in maps.read_text(), "the weights file is mmapped"


def _write_raw(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


@pytest.mark.parametrize("case,words", [
    ("short", "too short"),
    ("huge_header", "header length"),
    ("bad_json", "not valid JSON"),
    ("not_object", "not a JSON object"),
    ("bad_dtype", "is not supported"),
    ("bad_offsets", "do not hold shape"),
    ("past_end", "the file has"),
    ("bad_shape", "bad shape"),
])
def test_corrupt_files_are_one_clear_error_naming_the_file(tmp_path: Path, case: str, words: str) -> None:
    f = tmp_path / "m.safetensors"
    meta = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    if case == "short":
        f.write_bytes(b"\x01\x02")
    elif case == "huge_header":
        _write_raw(f, meta, length=1 << 40)
    elif case == "bad_json":
        _write_raw(f, b"{not json", b"")
    elif case == "not_object":
        _write_raw(f, [1, 2])
    elif case == "bad_dtype":
        _write_raw(f, {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    elif case == "bad_offsets":
        _write_raw(f, {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, bytes(16))
    elif case == "past_end":
        _write_raw(f, meta, bytes(8))  # 16 bytes promised, 8 present
    elif case == "bad_shape":
        _write_raw(f, {"w": {"dtype": "F32", "shape": [-2, 2], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(ModelFormatError, match=words) as info:
        SafetensorsFiles(tmp_path)
    assert str(f) in str(info.value) and "\n" not in str(info.value)


def test_a_file_truncated_after_the_header_was_read_is_reported_on_read(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(64, 64)}, f)
    files = SafetensorsFiles(tmp_path)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 100)
    with pytest.raises(ModelFormatError, match="cut short"):
        files.get("w")


def test_a_tensor_in_two_files_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(ModelFormatError, match="also in"):
        SafetensorsFiles(tmp_path)
