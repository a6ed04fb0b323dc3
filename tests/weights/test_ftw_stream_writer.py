"""FtwStreamWriter: tensors written as row blocks, interleaved, give the same FTW as whole tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moed.weights.ftw_reader import load_ftw, read_ftw_index
from moed.weights.ftw_writer import FtwStreamWriter, TensorSpec, write_ftw

META = {"note": "test"}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(10, 7, generator=g), "b.q": torch.randint(0, 255, (10, 3, 5), generator=g, dtype=torch.uint8),
            "b.scale": torch.randn(10, 2, generator=g).to(torch.bfloat16), "w": torch.randn(33, generator=g)}


def test_interleaved_row_blocks_give_the_bytes_and_checksums_of_whole_tensors(tmp_path: Path) -> None:
    tensors = _tensors()
    whole = write_ftw(tmp_path / "whole", {n: ("weight", t) for n, t in tensors.items()}, metadata=META,
                      source_fingerprint="x", shard_size=8192)
    specs = [TensorSpec(n, "weight", t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    with FtwStreamWriter(tmp_path / "rows", specs, shard_size=8192) as writer:
        writer.write("w", tensors["w"])
        for start in range(0, 10, 3):  # a, b.q and b.scale in blocks of 3 rows, interleaved
            for name in ("a", "b.q", "b.scale"):
                writer.write_rows(name, start, tensors[name][start:start + 3])
        rows = writer.finish(metadata=META, source_fingerprint="x")
    a, b = read_ftw_index(whole), read_ftw_index(rows)
    for name in tensors:
        ta, tb = a.tensors[name], b.tensors[name]
        assert (ta.crc32, ta.size, ta.shape, ta.dtype) == (tb.crc32, tb.size, tb.shape, tb.dtype), name
    _, loaded = load_ftw(rows, verify=True)
    for name, t in tensors.items():
        assert torch.equal(loaded[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


def test_out_of_order_blocks_and_incomplete_tensors_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    spec = TensorSpec("a", "weight", torch.float32, (4, 2))
    with pytest.raises(ValueError, match="in order"):
        with FtwStreamWriter(tmp_path / "m", [spec]) as writer:
            writer.write_rows("a", 2, torch.zeros(2, 2))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="incomplete"):
        with FtwStreamWriter(tmp_path / "m", [spec]) as writer:
            writer.write_rows("a", 0, torch.zeros(2, 2))
            writer.finish(metadata=META, source_fingerprint="x")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="reserved"):
        with FtwStreamWriter(tmp_path / "m", [spec]) as writer:
            writer.write_rows("a", 0, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="reserved"):
        with FtwStreamWriter(tmp_path / "m", [spec]) as writer:
            writer.write("a", torch.zeros(4, 2, dtype=torch.float64))
    assert list(tmp_path.iterdir()) == []
