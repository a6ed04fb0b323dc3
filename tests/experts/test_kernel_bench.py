"""kernel_bench: each kernel pass is paired with the reads just before and after it; its native read pass
and back-to-back MoE calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moed.experts import kernel_bench
from moed.kernels.native_cpu import native


def test_a_pass_is_paired_with_the_reads_around_it(monkeypatch) -> None:
    # reads of 4 bytes taking 1, 3, 1, 1 s and kernel passes of 8 bytes taking 2, 6, 1 s between
    # them: pass 1 against the mean read time (1 + 3) / 2 = 2 s: (8/2) / (4/2) = 2; pass 2 against
    # (3 + 1) / 2: (8/6) / 2 = 0.67; pass 3 against 1 s: 8 / 4 = 2 -> median 2 (pairing with the
    # read before only would give 1, 1, 2 -> 1)
    buf, buf_4k = np.zeros(1, np.float32), np.zeros(2, np.float32)
    reads = iter([1.0, 3.0, 1.0, 1.0])
    monkeypatch.setattr(kernel_bench, "_read_pass", lambda b: 9.0 if b is buf_4k else next(reads))
    passes = iter([2.0, 6.0, 1.0])
    m = kernel_bench._alternate(lambda: next(passes), buf, buf_4k, trials=3, nbytes=8)
    assert m["best_pass"] == 1.0
    assert m["read_gbps"] == pytest.approx(4 / 1.0 / 1e9)
    assert m["read_4k_gbps"] == pytest.approx(8 / 9.0 / 1e9)
    assert m["paired_ratio"] == pytest.approx(2.0)


def test_an_even_number_of_rounds_takes_the_middle_two(monkeypatch) -> None:
    buf, buf_4k = np.zeros(1, np.float32), np.zeros(1, np.float32)
    monkeypatch.setattr(kernel_bench, "_read_pass", lambda b: 1.0)  # 4 B/s everywhere
    passes = iter([1.0, 2.0])  # 8 and 4 B/s -> ratios 2 and 1
    m = kernel_bench._alternate(lambda: next(passes), buf, buf_4k, trials=2, nbytes=8)
    assert m["paired_ratio"] == pytest.approx(1.5)


def test_the_read_pass_reads_every_byte_at_every_isa():
    """``moed bench kernels``'s read bandwidth: every byte of the buffer is read (its sum proves it), on the
    pool's tasks (three whole ones and a short one)."""
    lib = native()
    if lib is None:
        pytest.skip("the native CPU kernels are not built")
    data = np.random.default_rng(5).integers(0, 256, size=3 * 262144 + 8 * 37 + 5, dtype=np.uint8)
    whole = data.size // 8 * 8
    want = int(data[:whole].view(np.uint64).sum(dtype=np.uint64)) + int(data[whole:].sum())
    previous = lib.set_isa(None)
    try:
        for isa in lib.available_isas():
            lib.set_isa(isa)
            seconds, total = lib.read_pass(torch.from_numpy(data))
            assert total == want % 2**64, isa
            assert seconds > 0
    finally:
        lib.set_isa(previous)
    with pytest.raises(ValueError, match="contiguous"):
        lib.read_pass(torch.zeros(8, 8)[:, ::2])


def test_the_benchmarks_back_to_back_calls_check_their_ids():
    """``moe_ggml_calls`` (the benchmark's expert pass) checks every call's ids as ``moe_ggml`` does."""
    from moed.experts.kernel_bench import _random_ggml_bank

    lib = native()
    if lib is None:
        pytest.skip("the native CPU kernels are not built")
    bank = _random_ggml_bank(256, 64, "ggml:Q4_0", 1, 0)
    x = torch.randn(1, 256)
    w = torch.full((1, 2), 0.5)
    ids = [torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[2, 3]], dtype=torch.int32)]
    assert lib.moe_ggml_calls(bank, 0, x, ids, w) > 0
    with pytest.raises(ValueError, match="refused"):
        lib.moe_ggml_calls(bank, 0, x, [ids[0], torch.tensor([[0, bank.num_experts]], dtype=torch.int32)], w)
    with pytest.raises(ValueError, match=r"\[1, A\]"):
        lib.moe_ggml_calls(bank, 0, x, [torch.zeros(2, 2, dtype=torch.int32)], w)
