"""Hostile and corrupt GGUF headers (issue #31): a clear one-line error or a correct load, never a hang,
a crash or an allocation the file's contents do not bound.

gguf's reader loops over counts read from the file and makes a numpy view per array item; past the
end of the file its slices come back empty without an error, so an array that claims 2**60 items
in a 1 KB file used to loop forever appending empty views. The headers here are written byte by
byte (the GGUF layout: magic, version, tensor count, key count, key/values, tensor infos).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap

import pytest

from helpers.gguf_writer import write_tiny_gguf
from moed.errors import ModelFormatError
from moed.weights import gguf_file
from moed.weights.gguf_checkpoint import GgufCheckpoint
from moed.weights.gguf_file import GgufFile

U8, U32, F32, STRING, ARRAY, U64 = 0, 4, 6, 8, 9, 10


def _str(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, value: bytes) -> bytes:
    return _str(key) + struct.pack("<I", kind) + value


def array(item_kind: int, count: int, items: bytes = b"") -> bytes:
    return struct.pack("<IQ", item_kind, count) + items


def tensor_info(name: str, ne: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    return _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", ggml_type,
                                                                                                  offset)


def header(kvs: list[bytes], tensors: list[bytes] = (), *, tensor_count: int | None = None,
           kv_count: int | None = None, tail: bytes = b"") -> bytes:
    counts = struct.pack("<QQ", len(tensors) if tensor_count is None else tensor_count,
                         len(kvs) if kv_count is None else kv_count)
    return b"GGUF" + struct.pack("<I", 3) + counts + b"".join(kvs) + b"".join(tensors) + tail


ARCH = kv("general.architecture", STRING, _str("qwen3moe"))


def _write(tmp_path, data: bytes):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    return path


def _refused(path, pattern: str) -> str:
    with pytest.raises(ModelFormatError, match=pattern) as info:
        GgufFile(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize("count,says", [(1 << 60, "more than moed reads"), (1 << 21, "cut short or corrupt")])
def test_an_array_claiming_more_items_than_the_file_holds_fails_at_once_in_bounded_memory(tmp_path, count, says):
    """Before the bound, gguf's reader looped forever here (empty slices past the end of the file) and
    grew a list without end: run in a child with a memory cap and a time limit."""
    path = _write(tmp_path, header([ARCH, kv("tokenizer.ggml.scores", ARRAY, array(U8, count, bytes(64)))],
                                   tail=bytes(1024)))
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
        from moed.errors import ModelFormatError
        from moed.weights.gguf_file import GgufFile
        try:
            GgufFile({str(path)!r})
        except ModelFormatError as exc:
            print("REFUSED", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in done.stdout and says in done.stdout, done.stdout + done.stderr[-2000:]


def test_an_array_over_the_item_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_file, "MAX_ARRAY_ITEMS", 100)
    path = _write(tmp_path, header([ARCH, kv("x.list", ARRAY, array(U32, 101, bytes(4 * 101)))]))
    _refused(path, r"claims 101 items in a metadata array, more than moed reads \(at most 100\)")


def test_all_string_arrays_together_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_file, "MAX_STRING_ITEMS", 5)
    words = b"".join(_str("ab") for _ in range(3))
    path = _write(tmp_path, header([ARCH, kv("a", ARRAY, array(STRING, 3, words)),
                                    kv("b", ARRAY, array(STRING, 3, words))]))
    _refused(path, r"more than 5 strings in all")


def test_numeric_arrays_read_whole_and_strings_item_by_item(tmp_path):
    scores = struct.pack("<3f", 0.5, -1.25, 1e-6)
    words = _str("hello") + _str("wörld")
    path = _write(tmp_path, header([ARCH, kv("t.scores", ARRAY, array(F32, 3, scores)),
                                    kv("t.ids", ARRAY, array(U32, 2, struct.pack("<2I", 7, 9))),
                                    kv("t.empty", ARRAY, array(U32, 0)), kv("t.none", ARRAY, array(STRING, 0)),
                                    kv("t.words", ARRAY, array(STRING, 2, words))]))
    meta = GgufFile(path).metadata
    assert meta["t.scores"] == [0.5, -1.25, 1e-6] and meta["t.ids"] == [7, 9]
    assert meta["t.empty"] == [] and meta["t.none"] == [] and meta["t.words"] == ["hello", "wörld"]


def test_a_string_claiming_more_bytes_than_the_file_holds(tmp_path):
    for length, says in ((1 << 62, r"claims 4611686018427387904 bytes in a string, more than moed reads"),
                         (1 << 20, r"cut short or corrupt.*claims 1048576 bytes in a string, more than the \d+ "
                                   r"bytes left can hold")):
        path = _write(tmp_path, header([ARCH, kv("tokenizer.chat_template", STRING, struct.pack("<Q", length) + b"{{")],
                                       tail=bytes(256)))
        _refused(path, says)


def test_a_string_over_the_length_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_file, "MAX_STRING_BYTES", 32)
    path = _write(tmp_path, header([ARCH, kv("general.name", STRING, _str("a model name longer than 32 bytes"))]))
    _refused(path, r"claims 33 bytes in a string, more than moed reads \(at most 32\)")


def test_nested_arrays_are_refused(tmp_path):
    inner = array(U32, 1, struct.pack("<I", 3))
    path = _write(tmp_path, header([ARCH, kv("x.nested", ARRAY, array(ARRAY, 1, inner))]))
    _refused(path, r"holds arrays")


@pytest.mark.parametrize("field", ["tensor_count", "kv_count"])
def test_huge_tensor_and_key_counts(tmp_path, field):
    path = _write(tmp_path, header([ARCH], **{field: 1 << 60}, tail=bytes(512)))
    _refused(path, r"more than moed reads")


def test_counts_the_file_cannot_hold_read_as_truncation(tmp_path):
    path = _write(tmp_path, header([ARCH], tensor_count=1000, tail=bytes(64)))
    _refused(path, r"claims 1000 tensors, more than the \d+ bytes left can hold")


def test_an_unknown_tensor_type_id(tmp_path):
    path = _write(tmp_path, header([ARCH], [tensor_info("token_embd.weight", (32, 4), ggml_type=99)],
                                   tail=bytes(64)))
    _refused(path, r"GGML type id 99, which ggml does not define")


def test_overflowing_dims_read_as_a_truncated_file(tmp_path):
    path = _write(tmp_path, header([ARCH], [tensor_info("token_embd.weight", ((1 << 63) + 32, 1 << 62))],
                                   tail=bytes(64)))
    _refused(path, r"truncated: tensor 'token_embd\.weight' ends at byte \d+")


def _set_u32(path, key: str, value: int) -> None:
    """Overwrite one UINT32 metadata value in place (the key is found by its length-prefixed name)."""
    data = bytearray(path.read_bytes())
    at = data.index(_str(key) + struct.pack("<I", U32)) + 8 + len(key) + 4
    data[at:at + 4] = struct.pack("<I", value)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("key", ["qwen3moe.attention.head_count", "qwen3moe.embedding_length",
                                 "qwen3moe.attention.key_length", "qwen3moe.attention.head_count_kv",
                                 "qwen3moe.expert_count", "qwen3moe.block_count"])
def test_a_zero_dimension_in_the_metadata_names_the_key(tmp_path, key):
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path)
    _set_u32(path, key, 0)
    with pytest.raises(ModelFormatError) as info:
        GgufCheckpoint(path)
    message = str(info.value)
    assert "\n" not in message and f"metadata {key} should be one positive integer, got 0" in message, message
