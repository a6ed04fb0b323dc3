"""FTW container: what is written is loaded back bit-exactly, aligned, in any subset."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from moed.errors import ModelFormatError
from moed.weights.ftw_format import crc32_combine, source_fingerprint_of
from moed.weights.ftw_reader import extra_file_path, load_ftw, read_ftw_index
from moed.weights.ftw_writer import write_ftw


def _sample() -> dict[str, tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": ("weight", torch.randn(7, 13, generator=g)),
        "bf16": ("weight", torch.randn(5, 3, 4, generator=g).to(torch.bfloat16)),
        "f16": ("weight", torch.randn(33, generator=g).to(torch.float16)),
        "u8": ("weight", torch.randint(0, 256, (4097,), generator=g, dtype=torch.uint8)),
        "i8": ("weight", torch.randint(-128, 128, (3, 3), generator=g, dtype=torch.int8)),
        "i16": ("weight", torch.randint(-(2**15), 2**15, (9,), generator=g, dtype=torch.int16)),
        "i32": ("weight", torch.randint(-(2**31), 2**31, (2, 2048), generator=g, dtype=torch.int32)),
        "i64": ("weight", torch.arange(-5, 1000, dtype=torch.int64)),
        "bool": ("weight", torch.rand(11, 3, generator=g) > 0.5),
        "scalar": ("weight", torch.tensor(3.5)),
        "scalar_bool": ("weight", torch.tensor(True)),
        "empty": ("weight", torch.empty(0, 4)),
        "empty_bf16": ("weight", torch.empty(3, 0, dtype=torch.bfloat16)),
        "bank.gate_up": ("expert_bank", torch.randn(4, 64, 96, generator=g).to(torch.bfloat16)),
        "bank.down": ("expert_bank", torch.randn(4, 48, 64, generator=g)),
        "noncontig": ("weight", torch.randn(6, 10, generator=g).t()),
    }


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    # compare raw bytes: NaN-safe and exact for bf16
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))


def test_round_trip_many_dtypes_shapes_and_shards(tmp_path: Path) -> None:
    tensors = _sample()
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "toy"}')
    meta = {"config": {"hidden_size": 64}, "banks": ["bank.gate_up", "bank.down"]}
    dst = write_ftw(
        tmp_path / "model",
        tensors,
        metadata=meta,
        source_fingerprint="sha256:abc",
        extra_files={"config.json": cfg, "tokenizer.json": b'{"v": 1}'},
        shard_size=16 << 10,
    )
    index = read_ftw_index(dst)
    assert len(index.files) > 2  # small shard_size forced several shards
    assert index.metadata == meta and index.source_fingerprint == "sha256:abc"
    assert [t.kind for t in index.tensors.values()].count("expert_bank") == 2
    for f in index.files.values():
        assert (dst / f.name).stat().st_size == f.size and f.size % 4096 == 0
    assert extra_file_path(dst, "config.json").read_text() == '{"model_type": "toy"}'
    assert extra_file_path(dst, "tokenizer.json").read_bytes() == b'{"v": 1}'

    for verify, direct in [(False, True), (True, True), (True, False)]:
        _, out = load_ftw(dst, verify=verify, direct=direct, num_threads=3)
        assert list(out) == list(tensors)
        for name, (_, want) in tensors.items():
            _assert_same(out[name], want)
            if out[name].numel():
                assert out[name].data_ptr() % 4096 == 0, name


def test_big_tensor_is_read_in_chunks_and_verified(tmp_path: Path) -> None:
    bank = torch.randn(3, 200_001)  # > 2 MiB (huge-page buffer), tail not a multiple of 4096 bytes
    dst = write_ftw(tmp_path / "m", {"bank": ("expert_bank", bank), "w": ("weight", torch.ones(3))},
                    metadata={}, source_fingerprint="x")
    seen: list[tuple[int, int]] = []
    _, out = load_ftw(dst, verify=True, chunk_size=256 << 10, num_threads=4,
                      progress=lambda d, t: seen.append((d, t)))
    _assert_same(out["bank"], bank)
    assert len(seen) > 1 and seen[-1][0] == seen[-1][1]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_tensor_bigger_than_shard_size_gets_its_own_shard(tmp_path: Path) -> None:
    tensors = {"a": ("weight", torch.ones(10)), "big": ("expert_bank", torch.zeros(5000)),
               "b": ("weight", torch.ones(10))}
    dst = write_ftw(tmp_path / "m", tensors, metadata={}, source_fingerprint="x", shard_size=8192)
    index = read_ftw_index(dst)
    assert len({index.tensors[n].file for n in tensors}) == 3
    assert index.tensors["big"].offset == 0


def test_names_subset(tmp_path: Path) -> None:
    tensors = _sample()
    dst = write_ftw(tmp_path / "m", tensors, metadata={}, source_fingerprint="x", shard_size=8192)
    index, out = load_ftw(dst, names=["bank.down", "scalar", "empty"], verify=True)
    assert set(out) == {"bank.down", "scalar", "empty"}
    assert len(index.tensors) == len(tensors)
    for name in out:
        _assert_same(out[name], tensors[name][1])


@pytest.mark.parametrize("dtype", ["q8", "mxfp4"])
def test_block_scaled_banks_round_trip(tmp_path: Path, dtype: str) -> None:
    """q8 (int8 + fp16) and mxfp4 (uint8 + uint8) banks, with gpt-oss's biases, come back bit-exactly and run."""
    from moed.cache.bank_builder import build_expert_bank
    from moed.cache.host_bank import ExpertActivation, ExpertBank
    from moed.experts.expert_ffn import run_expert
    from moed.weights.model_loader import BANK_PREFIX, _check_bank_shapes

    g = torch.Generator().manual_seed(1)
    n, d, i = 6, 64, 32
    bank = build_expert_bank(torch.randn(n, d, 2 * i, generator=g), torch.randn(n, i, d, generator=g),
                             num_moe_layers=2, num_experts=3, dtype=dtype, activation=ExpertActivation("gpt_oss"),
                             gate_up_bias=torch.randn(n, 2 * i, generator=g), down_bias=torch.randn(n, d, generator=g))
    tensors = {BANK_PREFIX + k: ("expert_bank", t) for k, t in bank.tensors.items()}
    dst = write_ftw(tmp_path / "m", tensors, metadata={}, source_fingerprint="x", shard_size=8192)
    _, out = load_ftw(dst, verify=True)
    for name, (_, want) in tensors.items():
        _assert_same(out[name], want)
    loaded = ExpertBank(num_moe_layers=2, num_experts=3, hidden_size=d, intermediate_size=i, dtype=dtype,
                        activation=bank.activation, tensors={k[len(BANK_PREFIX):]: t for k, t in out.items()})
    _check_bank_shapes(loaded, "test")  # what loading an FTW model checks
    x = torch.randn(2, d, generator=g)
    assert torch.equal(run_expert(loaded, 4, x), run_expert(bank, 4, x))
    main = "gate_up.qs" if dtype == "q8" else "gate_up.fp4"
    short = ExpertBank(**{**loaded.__dict__, "tensors": {**loaded.tensors, main: loaded.tensors[main][:, :32]}})
    with pytest.raises(ModelFormatError, match=main):
        _check_bank_shapes(short, "test")


def test_writer_progress_and_overwrite(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    dst = write_ftw(tmp_path / "m", {"a": ("weight", torch.ones(100))}, metadata={},
                    source_fingerprint="1", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (400, 400)
    write_ftw(dst, {"b": ("weight", torch.zeros(3))}, metadata={}, source_fingerprint="2", overwrite=True)
    index, out = load_ftw(dst / "ftw.json")  # the index path itself is accepted too
    assert index.source_fingerprint == "2" and list(out) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp or old dirs left


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux-only")
@pytest.mark.parametrize("refuse", ["open", "read"])
def test_falls_back_to_plain_reads_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse: str
) -> None:
    """Filesystems without O_DIRECT say EINVAL at open (or only at the first read)."""
    import errno
    import fcntl

    bank = torch.randn(2, 70_000)
    dst = write_ftw(tmp_path / "m", {"bank": ("expert_bank", bank)}, metadata={}, source_fingerprint="x")
    real_open, real_preadv = os.open, os.preadv

    def fake_open(path: Any, flags: int, *args: Any) -> int:
        if refuse == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def fake_preadv(fd: int, buffers: Any, offset: int) -> int:
        if refuse == "read" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)
    _, out = load_ftw(dst, verify=True, chunk_size=64 << 10)
    _assert_same(out["bank"], bank)


def test_crc32_combine_matches_zlib() -> None:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (70_000,), generator=g, dtype=torch.uint8).numpy().tobytes()
    for cut in (0, 1, 4096, 12_345, 70_000):
        a, b = data[:cut], data[cut:]
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def test_source_fingerprint(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(os.urandom(3 << 20))
    b.write_bytes(b"small")
    fp = source_fingerprint_of([a, b])
    assert fp.startswith("sha256:") and fp == source_fingerprint_of([b, a])
    raw = bytearray(a.read_bytes())
    raw[-1] ^= 1
    a.write_bytes(bytes(raw))
    assert source_fingerprint_of([a, b]) != fp


@pytest.mark.skipif(not os.environ.get("MOED_FTW_BENCH"), reason="manual benchmark: set MOED_FTW_BENCH=1")
def test_load_speed_manual(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Manual: ``MOED_FTW_BENCH=1 pytest tests/weights/test_ftw_roundtrip.py -k speed -s``.

    MOED_FTW_BENCH_DIR picks the filesystem (default: pytest's tmp dir), MOED_FTW_BENCH_GB the size.
    """
    base = Path(os.environ.get("MOED_FTW_BENCH_DIR") or tmp_path_factory.mktemp("bench"))
    gb = float(os.environ.get("MOED_FTW_BENCH_GB", "1"))
    bank = torch.empty(int(gb * (1 << 30)) // 2, dtype=torch.bfloat16).fill_(1.5)
    t0 = time.perf_counter()
    dst = write_ftw(base / "ftw-bench", {"bank": ("expert_bank", bank)}, metadata={},
                    source_fingerprint="bench", overwrite=True)
    print(f"\nwrite {bank.nbytes / 1e9:.2f} GB: {bank.nbytes / 1e9 / (time.perf_counter() - t0):.2f} GB/s")
    del bank
    shard = dst / "shard-00000.bin"

    def evict() -> None:
        fd = os.open(shard, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    for label, direct, cold, verify in [("direct cold", True, True, False), ("plain cold", False, True, False),
                                        ("plain warm", False, False, False), ("direct cold+verify", True, True, True)]:
        speeds = []
        for _ in range(3):  # shared machines are noisy: show every run
            if cold:
                evict()
            t0 = time.perf_counter()
            index, out = load_ftw(dst, direct=direct, verify=verify)
            speeds.append(index.nbytes() / 1e9 / (time.perf_counter() - t0))
            del out
        print(f"{label:20s} GB/s: " + ", ".join(f"{v:.2f}" for v in speeds))
    import shutil
    shutil.rmtree(dst)
