"""expert_matmul (numba) against expert_matmul_reference (torch), for fp32, bf16, int4, q8 and mxfp4 banks."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
import torch

from moed.kernels.block_scaled_matmul import matmul_mxfp4_kernel, matmul_q8_kernel
from moed.kernels.expert_matmul import (
    DIRECT_MAX_TOKENS,
    MATMUL_RTOL,
    PREFILL_RTOL,
    bf16_bits,
    expert_matmul,
    expert_matmul_reference,
    expert_weight_reference,
    threading_layer,
)
from moed.kernels.int4_format import quantize_int4, unpack_int4
from moed.kernels.mxfp4_format import quantize_mxfp4
from moed.kernels.q8_format import quantize_q8

FMTS = ("fp32", "bf16", "int4", "q8", "mxfp4")


def _bank(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A one-matrix bank ``down`` from float32 ``w [E, K, N]``."""
    if fmt == "fp32":
        return {"down": w.contiguous()}
    if fmt == "bf16":
        return {"down": w.to(torch.bfloat16)}
    if fmt == "q8":
        qs, d = quantize_q8(w)
        return {"down.qs": qs, "down.d": d}
    if fmt == "mxfp4":
        fp4, e8m0 = quantize_mxfp4(w)
        return {"down.fp4": fp4, "down.e8m0": e8m0}
    q, scale, mn = quantize_int4(w)
    return {"down.q": q, "down.scale": scale, "down.min": mn}


def _bound(bank: dict[str, torch.Tensor], fid: int, x: torch.Tensor) -> torch.Tensor:
    """``MATMUL_RTOL * (|x| @ A)``, the documented tolerance (``PREFILL_RTOL`` for the bf16 prefill GEMM
    of every bank but fp32)."""
    fp32 = "down" in bank and bank["down"].dtype == torch.float32
    rtol = PREFILL_RTOL if x.shape[0] > DIRECT_MAX_TOKENS and not fp32 else MATMUL_RTOL
    if "down.q" in bank:
        s = bank["down.scale"][fid].float().repeat_interleave(32, dim=0)
        m = bank["down.min"][fid].float().repeat_interleave(32, dim=0)
        a = (unpack_int4(bank["down.q"][fid]).float() + 16) * s.abs() + m.abs()
    else:  # fp32, bf16, q8, mxfp4: A = |W|
        a = expert_weight_reference(bank, "down", fid).abs()
    return rtol * (x.abs() @ a) + 1e-30


def _check(fmt: str, k: int, n: int, tokens: int, experts: int = 3) -> None:
    gen = torch.Generator().manual_seed(k * 1000 + n + tokens)
    w = torch.randn(experts, k, n, generator=gen) + 0.3  # offset: min far from 0 for int4
    bank = _bank(fmt, w)
    x = torch.randn(tokens, k, generator=gen)
    for fid in range(experts):
        y = expert_matmul(bank, "down", fid, x)
        ref = expert_matmul_reference(bank, "down", fid, x)
        assert y.shape == (tokens, n) and y.dtype == torch.float32
        excess = (y - ref).abs() - _bound(bank, fid, x)
        assert float(excess.max()) <= 0.0, f"{fmt} K={k} N={n} T={tokens} expert {fid}"


@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
@pytest.mark.parametrize("k,n", [(1, 5), (3, 7), (33, 10), (96, 34), (576, 3072)])
def test_dense_kernels(fmt: str, k: int, n: int, tokens: int) -> None:
    _check(fmt, k, n, tokens)


@pytest.mark.parametrize("tokens", [1, 3, 16, 40])
@pytest.mark.parametrize("k,n", [(32, 2), (64, 10), (96, 34), (576, 3072), (1536, 576)])
def test_int4_kernel(k: int, n: int, tokens: int) -> None:
    _check("int4", k, n, tokens)


@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 40])
@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
@pytest.mark.parametrize("k,n", [(32, 2), (64, 10), (96, 34), (576, 3072), (1536, 576)])
def test_block_scaled_kernels(fmt: str, k: int, n: int, tokens: int) -> None:
    _check(fmt, k, n, tokens)


@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
def test_block_scaled_kernels_on_random_shapes(fmt: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(12):
        k = 32 * int(rng.integers(1, 17))
        n = 2 * int(rng.integers(1, 160))
        _check(fmt, k, n, int(rng.integers(1, 17)), experts=2)


@pytest.mark.parametrize("nparts", [1, 3, 5, 7, 40])
@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
def test_block_scaled_kernels_with_odd_part_counts(fmt: str, nparts: int) -> None:
    """K split into 1..40 blocks (more blocks than groups leaves some empty) gives the same result."""
    gen = torch.Generator().manual_seed(nparts)
    k, n, tokens = 160, 66, 3
    bank = _bank(fmt, torch.randn(1, k, n, generator=gen))
    x = torch.randn(tokens, k, generator=gen)
    out = np.empty((tokens, n), np.float32)
    if fmt == "q8":
        matmul_q8_kernel(x.numpy(), bank["down.qs"][0].numpy(), bf16_bits(bank["down.d"][0]), nparts, out)
    else:
        matmul_mxfp4_kernel(x.numpy(), bank["down.fp4"][0].numpy(), bank["down.e8m0"][0].numpy(), nparts, out)
    ref = expert_matmul_reference(bank, "down", 0, x)
    assert float(((torch.from_numpy(out) - ref).abs() - _bound(bank, 0, x)).max()) <= 0.0


@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
def test_block_scaled_kernels_apply_every_groups_scale(fmt: str) -> None:
    """Groups whose scales differ by up to 2**12: a kernel that ignored (or misplaced) them fails."""
    gen = torch.Generator().manual_seed(9)
    k, n = 256, 40
    spread = torch.exp2(torch.randint(-6, 7, (1, k // 32, 1, n), generator=gen).float())
    w = (torch.randn(1, k // 32, 32, n, generator=gen) * spread).reshape(1, k, n)
    bank = _bank(fmt, w)
    x = torch.randn(2, k, generator=gen)
    y = expert_matmul(bank, "down", 0, x)
    ref = expert_matmul_reference(bank, "down", 0, x)
    bound = _bound(bank, 0, x)
    assert float(((y - ref).abs() - bound).max()) <= 0.0
    # the check has teeth: the same codes with one common scale give a result far outside the bound
    flat = dict(bank)
    key = "down.d" if fmt == "q8" else "down.e8m0"
    flat[key] = bank[key][:, :1].expand_as(bank[key]).contiguous()
    outside = (expert_matmul(flat, "down", 0, x) - ref).abs() > 100 * bound
    assert float(outside.float().mean()) > 0.9


def test_int4_tolerance_is_tight_in_practice() -> None:
    """The bound is loose on purpose; the kernel is far inside it."""
    gen = torch.Generator().manual_seed(7)
    bank = _bank("int4", torch.randn(1, 512, 256, generator=gen))
    x = torch.randn(2, 512, generator=gen)
    err = (expert_matmul(bank, "down", 0, x) - expert_matmul_reference(bank, "down", 0, x)).abs()
    assert float((err / _bound(bank, 0, x)).max()) < 0.1


@pytest.mark.parametrize("fmt", ["q8", "mxfp4"])
def test_block_scaled_tolerance_is_tight_in_practice(fmt: str) -> None:
    gen = torch.Generator().manual_seed(7)
    bank = _bank(fmt, torch.randn(1, 512, 256, generator=gen))
    x = torch.randn(2, 512, generator=gen)
    err = (expert_matmul(bank, "down", 0, x) - expert_matmul_reference(bank, "down", 0, x)).abs()
    assert float((err / _bound(bank, 0, x)).max()) < 0.1


@pytest.mark.parametrize("fmt", FMTS)
def test_zero_tokens(fmt: str) -> None:
    bank = _bank(fmt, torch.randn(1, 32, 4))
    assert expert_matmul(bank, "down", 0, torch.empty(0, 32)).shape == (0, 4)


def test_bad_inputs_raise() -> None:
    w = torch.randn(2, 64, 8)
    banks = {fmt: _bank(fmt, w) for fmt in FMTS}
    x = torch.randn(1, 64)
    for bank in banks.values():
        with pytest.raises(ValueError, match="float32"):
            expert_matmul(bank, "down", 0, x.double())
        with pytest.raises(ValueError, match=r"\[T, 64\]"):
            expert_matmul(bank, "down", 0, torch.randn(1, 63))
        with pytest.raises(ValueError, match="contiguous"):
            expert_matmul(bank, "down", 0, torch.randn(64, 2).t())
        with pytest.raises(ValueError, match="out of range"):
            expert_matmul(bank, "down", 2, x)
        with pytest.raises(ValueError, match="not one of"):
            expert_matmul(bank, "up", 0, x)
        with pytest.raises(ValueError, match="has no"):
            expert_matmul(bank, "gate_up", 0, x)
    int4 = dict(banks["int4"])
    del int4["down.min"]
    with pytest.raises(ValueError, match="down.min"):
        expert_matmul(int4, "down", 0, x)
    int4 = dict(banks["int4"], **{"down.scale": banks["int4"]["down.scale"].float()})
    with pytest.raises(ValueError, match="bfloat16"):
        expert_matmul(int4, "down", 0, x)
    q8 = dict(banks["q8"], **{"down.d": banks["q8"]["down.d"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="float16"):
        expert_matmul(q8, "down", 0, x)
    q8 = {"down.qs": banks["q8"]["down.qs"]}
    with pytest.raises(ValueError, match="down.d"):
        expert_matmul(q8, "down", 0, x)
    mx = dict(banks["mxfp4"], **{"down.e8m0": banks["mxfp4"]["down.e8m0"][:, :1]})
    with pytest.raises(ValueError, match="shape"):
        expert_matmul(mx, "down", 0, x)
    mx = dict(banks["mxfp4"], **{"down.fp4": banks["mxfp4"]["down.fp4"].to(torch.int8)})
    with pytest.raises(ValueError, match="uint8"):
        expert_matmul(mx, "down", 0, x)
    with pytest.raises(ValueError, match="multiple of"):
        expert_matmul({"down.qs": torch.zeros(1, 48, 4, dtype=torch.int8),
                       "down.d": torch.zeros(1, 1, 4, dtype=torch.float16)}, "down", 0, torch.randn(1, 48))
    with pytest.raises(ValueError, match="dtype"):
        expert_matmul({"down": w.half()}, "down", 0, x)
    with pytest.raises(ValueError, match="contiguous"):
        expert_matmul({"down": w.transpose(1, 2).contiguous().transpose(1, 2)}, "down", 0, x)


def test_threads_default_to_cores_and_match_torch() -> None:
    # The module sets both at import (unless NUMBA_NUM_THREADS / OMP_NUM_THREADS say otherwise).
    assert numba.get_num_threads() == torch.get_num_threads()
    assert threading_layer() in ("tbb", "omp", "workqueue")


def test_concurrent_calls_from_python_threads() -> None:
    gen = torch.Generator().manual_seed(3)
    banks = {fmt: _bank(fmt, torch.randn(2, 256, 130, generator=gen)) for fmt in FMTS}
    x = torch.randn(2, 256, generator=gen)
    want = {fmt: expert_matmul_reference(b, "down", 1, x) for fmt, b in banks.items()}
    errors: list[str] = []

    def work(fmt: str) -> None:
        for _ in range(50):
            y = expert_matmul(banks[fmt], "down", 1, x)
            if not torch.allclose(y, want[fmt], rtol=1e-4, atol=1e-3):
                errors.append(fmt)

    threads = [threading.Thread(target=work, args=(fmt,)) for fmt in FMTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_jit_works_without_a_cache_location() -> None:
    """Where numba finds no cache location, kernels compile uncached instead of failing."""
    from moed.kernels.expert_matmul import serial_njit

    ns: dict = {}
    exec("def add_one(a):\n    return a + 1\n", ns)  # no source file: no cache locator
    with pytest.raises(RuntimeError, match="no locator"):
        numba.njit(cache=True)(ns["add_one"])
    assert serial_njit(ns["add_one"])(1) == 2


# The read-bandwidth kernel and the benchmark helper live next to the kernels they measure.


def test_read_sum_kernel_matches_numpy() -> None:
    import numpy as np

    from moed.kernels.bandwidth import read_sum_kernel

    a = np.random.default_rng(0).random(100_003, dtype=np.float32)
    for nparts in (1, 2, 3):
        assert abs(read_sum_kernel(a, nparts) - float(a.sum(dtype=np.float64))) < 1e-3 * a.size


def test_bench_kernels_smoke() -> None:
    from moed.kernels.bandwidth import measure_read_bandwidth
    from moed.experts.kernel_bench import bench_kernels, format_table

    assert measure_read_bandwidth(8 * 2**20, repeats=1) > 0
    with pytest.raises(ValueError):
        measure_read_bandwidth(2**20)
    rows = bench_kernels([(64, 32)], ("bf16", "int4"), bank_bytes=2**20, read_bytes=8 * 2**20, trials=1)
    assert [r["dtype"] for r in rows] == ["bf16", "int4"]
    assert all(r["weight_gbps"] > 0 and r["ratio"] > 0 and r["experts"] >= 4 for r in rows)
    assert "| int4 | 64 | 32 |" in format_table(rows)


def test_prefill_gemm_shapes_are_bucketed(monkeypatch) -> None:
    """Each expert's token count reaches the bf16 GEMM rounded up to PREFILL_ROW_BUCKET rows (oneDNN caches
    a primitive per shape: one shape per count thrashed its capped caches), and the padding rows never
    show in the result."""
    from moed.kernels import expert_matmul as em
    from moed.kernels.prefill_gemm import prefill_gemm_dtype

    if prefill_gemm_dtype(torch.bfloat16, torch.device("cpu")) != torch.bfloat16:
        pytest.skip("this CPU multiplies prefill in float32 (MKL): no per-shape primitives to bound")
    gen = torch.Generator().manual_seed(5)
    bank = _bank("q8", torch.randn(1, 64, 48, generator=gen))
    seen = set()
    real = torch.matmul

    def spy(a, b):
        seen.add(a.shape[0])
        return real(a, b)

    monkeypatch.setattr(torch, "matmul", spy)
    counts = range(DIRECT_MAX_TOKENS + 1, DIRECT_MAX_TOKENS + 49)  # 48 token counts
    for tokens in counts:
        x = torch.randn(tokens, 64, generator=gen)
        y = expert_matmul(bank, "down", 0, x)
        assert y.shape == (tokens, 48)
        monkeypatch.setattr(torch, "matmul", real)
        ref = expert_matmul_reference(bank, "down", 0, x)
        monkeypatch.setattr(torch, "matmul", spy)
        assert float(((y - ref).abs() - _bound(bank, 0, x)).max()) <= 0.0
    assert seen and all(m % em.PREFILL_ROW_BUCKET == 0 for m in seen)
    assert len(seen) <= 4, f"{len(counts)} token counts reached the GEMM as {len(seen)} shapes"
