"""FTW container: damaged, partial or foreign directories are refused with a message naming the culprit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moed.errors import InvalidRequestError, ModelFormatError
from moed.weights import ftw_writer
from moed.weights.ftw_reader import extra_file_path, load_ftw, read_ftw_index
from moed.weights.ftw_writer import write_ftw


def _write(dst: Path, **kw: Any) -> Path:
    tensors = {
        "embed": ("weight", torch.arange(3000, dtype=torch.float32)),
        "bank.w": ("expert_bank", torch.arange(5000, dtype=torch.int32).reshape(2, 2500)),
        "norm": ("weight", torch.ones(8, dtype=torch.bfloat16)),
    }
    return write_ftw(dst, tensors, metadata={"k": 1}, source_fingerprint="fp",
                     extra_files={"config.json": b'{"a": 1}'}, shard_size=16 << 10, **kw)


def _edit_index(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((root / "ftw.json").read_text())
    edit(doc)
    (root / "ftw.json").write_text(json.dumps(doc))


def _refused(root: Path, *needles: str, verify: bool = False) -> str:
    with pytest.raises(ModelFormatError) as e:
        load_ftw(root, verify=verify)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def test_truncated_shard_names_file_and_sizes(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    shard = root / read_ftw_index(root).tensors["bank.w"].file
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 4096)
    msg = _refused(root, str(shard), str(size), str(size - 4096), "truncated")
    with pytest.raises(ModelFormatError, match="truncated"):
        read_ftw_index(root)
    assert "moed convert" in msg


def test_missing_shard(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    shard = root / read_ftw_index(root).tensors["norm"].file
    shard.unlink()
    _refused(root, str(shard), "missing")


def test_flipped_byte_caught_only_by_verify(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    t = read_ftw_index(root).tensors["bank.w"]
    with open(root / t.file, "r+b") as f:
        f.seek(t.offset + 12_345)
        b = f.read(1)
        f.seek(t.offset + 12_345)
        f.write(bytes([b[0] ^ 0x10]))
    _, out = load_ftw(root)  # without verify the damage goes unnoticed, by design
    assert not torch.equal(out["bank.w"], torch.arange(5000, dtype=torch.int32).reshape(2, 2500))
    _refused(root, "'bank.w'", t.file, "checksum", verify=True)


def test_flipped_byte_in_extra_file(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    (root / "config.json").write_bytes(b'{"a": 2}')
    load_ftw(root)
    _refused(root, "config.json", "checksum", verify=True)


def test_padding_damage_is_harmless(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    t = read_ftw_index(root).tensors["norm"]
    with open(root / t.file, "r+b") as f:
        f.seek(t.offset + t.size)
        f.write(b"\xff")
    load_ftw(root, verify=True)


def test_directory_without_index(tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "shard-00000.bin").write_bytes(bytes(4096))
    _refused(tmp_path / "half", str(tmp_path / "half"), "ftw.json", "moed convert")
    _refused(tmp_path / "nope", str(tmp_path / "nope"), "does not exist")
    (tmp_path / "file").write_text("x")
    _refused(tmp_path / "file", str(tmp_path / "file"), "not a directory")


@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]", "\xff\xfe garbage", "null"])
def test_garbage_index(tmp_path: Path, text: str) -> None:
    root = _write(tmp_path / "m")
    (root / "ftw.json").write_text(text, encoding="latin-1")
    _refused(root, str(root / "ftw.json"))


def test_foreign_format_and_future_version(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    _edit_index(root, lambda d: d.update(format="safetensors-index"))
    _refused(root, str(root / "ftw.json"), "'safetensors-index'", "not a moed weight index")
    _edit_index(root, lambda d: d.update(format="moed-ftw", version=2))
    _refused(root, str(root / "ftw.json"), "newer moed", "version 2")
    _edit_index(root, lambda d: d.update(version=0))
    _refused(root, "unsupported format version 0")
    _edit_index(root, lambda d: d.update(version=1, alignment=512))
    _refused(root, "alignment 512")


def _tensor_edit(name: str, **changes: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"][name].update(changes)

    return edit


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"offset": 1 << 20}, "beyond its recorded size"),
        ({"offset": 100}, "not a multiple of 4096"),
        ({"size": 9}, "takes 20000"),
        ({"shape": [2, 2501]}, "takes 20008"),
        ({"shape": [2, -1]}, "non-negative"),
        ({"dtype": "float8_e4m3"}, "unknown dtype"),
        ({"kind": "bias"}, "kind 'bias'"),
        ({"file": "shard-99999.bin"}, "not listed"),
        ({"crc32": -1}, "negative"),
        ({"offset": "0"}, "expected int"),
        ({"size": True}, "expected int"),
    ],
)
def test_bad_tensor_entries_name_the_tensor(tmp_path: Path, changes: dict[str, Any], needle: str) -> None:
    root = _write(tmp_path / "m")
    _edit_index(root, _tensor_edit("bank.w", **changes))
    _refused(root, "'bank.w'", str(root / "ftw.json"), needle)


def test_missing_tensor_field_and_overlap(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    _edit_index(root, lambda d: d["tensors"]["norm"].pop("crc32"))
    _refused(root, "'norm'", "'crc32'")
    root = _write(tmp_path / "m2")
    embed = read_ftw_index(root).tensors["embed"]  # 12000 bytes: "norm" fits inside its extent
    _edit_index(root, _tensor_edit("norm", file=embed.file, offset=embed.offset + 4096))
    _refused(root, "overlap", "'embed'", "'norm'")


def test_unknown_names_and_extra_files(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    with pytest.raises(ModelFormatError, match="'lm_head'"):
        load_ftw(root, names=["embed", "lm_head"])
    with pytest.raises(ModelFormatError, match="tokenizer.json"):
        extra_file_path(root, "tokenizer.json")
    (root / "config.json").unlink()
    _refused(root, str(root / "config.json"), "missing")


def test_existing_destination_needs_overwrite(tmp_path: Path) -> None:
    root = _write(tmp_path / "m")
    with pytest.raises(InvalidRequestError, match="--force") as e:
        _write(root)
    assert str(root) in str(e.value)
    load_ftw(root, verify=True)


def _crash_on_second_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ftw_writer._pwrite_all  # every tensor byte goes through it (one call per small tensor)
    calls = [0]

    def flaky(*args: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(28, "No space left on device (simulated)")
        return real(*args)

    monkeypatch.setattr(ftw_writer, "_pwrite_all", flaky)


def test_crash_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _crash_on_second_tensor(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        _write(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []  # neither dst nor a temp dir


def test_crash_mid_overwrite_keeps_the_old_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _write(tmp_path / "m")
    before = (root / "ftw.json").read_bytes()
    _crash_on_second_tensor(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        _write(root, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert (root / "ftw.json").read_bytes() == before
    load_ftw(root, verify=True)


def test_crash_before_index_is_not_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A temp dir caught between shards and ftw.json (e.g. after kill -9) cannot be loaded."""
    def killed(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ftw_writer, "index_to_json", killed)
    monkeypatch.setattr(ftw_writer.shutil, "rmtree", lambda *a, **k: None)  # as if the process died
    with pytest.raises(KeyboardInterrupt):
        _write(tmp_path / "m")
    (leftover,) = list(tmp_path.iterdir())
    assert leftover.name.startswith(".m.tmp-")
    assert not (tmp_path / "m").exists()
    _refused(leftover, "ftw.json", "did not finish")
