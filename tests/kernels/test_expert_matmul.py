"""expert_matmul (numba) against expert_matmul_reference (torch), for fp32, bf16 and int4 banks."""

from __future__ import annotations

import threading

import numba
import pytest
import torch

from moed.kernels.expert_matmul import (
    MATMUL_RTOL,
    expert_matmul,
    expert_matmul_reference,
    threading_layer,
)
from moed.kernels.int4_format import quantize_int4, unpack_int4

FMTS = ("fp32", "bf16", "int4")


def _bank(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """A one-matrix bank ``down`` from float32 ``w [E, K, N]``."""
    if fmt == "fp32":
        return {"down": w.contiguous()}
    if fmt == "bf16":
        return {"down": w.to(torch.bfloat16)}
    q, scale, mn = quantize_int4(w)
    return {"down.q": q, "down.scale": scale, "down.min": mn}


def _bound(bank: dict[str, torch.Tensor], fid: int, x: torch.Tensor) -> torch.Tensor:
    """``MATMUL_RTOL * (|x| @ A)``, the documented tolerance."""
    if "down.q" in bank:
        s = bank["down.scale"][fid].float().repeat_interleave(32, dim=0)
        m = bank["down.min"][fid].float().repeat_interleave(32, dim=0)
        a = (unpack_int4(bank["down.q"][fid]).float() + 16) * s.abs() + m.abs()
    else:
        a = bank["down"][fid].float().abs()
    return MATMUL_RTOL * (x.abs() @ a) + 1e-30


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


def test_int4_tolerance_is_tight_in_practice() -> None:
    """The bound is loose on purpose; the kernel is far inside it."""
    gen = torch.Generator().manual_seed(7)
    bank = _bank("int4", torch.randn(1, 512, 256, generator=gen))
    x = torch.randn(2, 512, generator=gen)
    err = (expert_matmul(bank, "down", 0, x) - expert_matmul_reference(bank, "down", 0, x)).abs()
    assert float((err / _bound(bank, 0, x)).max()) < 0.1


def test_zero_tokens() -> None:
    bank = _bank("int4", torch.randn(1, 32, 4))
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
