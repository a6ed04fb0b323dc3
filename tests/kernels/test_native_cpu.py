"""The native CPU kernels (native/cpu) against their plain-torch twins, on every ISA this CPU has."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.kernels.int4_format import quantize_int4
from moed.kernels.mxfp4_format import quantize_mxfp4
from moed.kernels.native_cpu import library_path, native
from moed.kernels.native_cpu_reference import matrix_product, routed_reference, strip_reference
from moed.kernels.q8_format import quantize_q8

DTYPES = ("fp32", "bf16", "int4", "q8", "mxfp4")
LIB = native()


def test_the_library_is_built_where_a_compiler_is():
    if LIB is None and os.environ.get("MOED_NATIVE", "1") == "0":
        pytest.skip("MOED_NATIVE=0")
    if shutil.which("cc") or shutil.which("gcc"):
        assert library_path() is not None, "pip install built no native kernels although a C compiler is present"
        assert LIB is not None
        assert LIB.backend.startswith("native-")


needs_lib = pytest.mark.skipif(LIB is None, reason="native CPU kernels not built")


def _matrix(dtype: str, k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    w = torch.randn(k, n, generator=gen)
    w[:, 1::7] *= 20  # columns of different magnitudes: scales differ per column
    if dtype == "fp32":
        return (w,)
    if dtype == "bf16":
        return (w.bfloat16(),)
    if dtype == "int4":
        return quantize_int4(w)
    if dtype == "q8":
        return quantize_q8(w)
    return quantize_mxfp4(w)


def _x(t: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(t, k, generator=gen)
    if k >= 64:
        x[:, 32:64] = 0  # an all-zero group: xs = 0
    return x


def _check(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs()
    limit = 1e-5 * bound + 1e-30
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite output"
    worst = float((err / limit).max())
    assert worst <= 1.0, f"{what}: error {worst:.2f}x the float32-order bound"


@pytest.mark.parametrize("dtype", DTYPES)
def test_strips_match_their_twins_on_odd_shapes(dtype, isa):
    gen = torch.Generator().manual_seed(DTYPES.index(dtype))
    ks = (32, 96, 2048) if dtype in ("int4", "q8", "mxfp4") else (1, 7, 33, 100, 2048)
    for k in ks:
        for n in (2, 18, 130, 1536, 2200):  # 2200: a strip wider than one T = 1 sweep window (1024)
            arrays = _matrix(dtype, k, n, gen)
            half = n // 2
            for t in (1, 2, 3, 5, 16, 64):
                if k * n * t > 2048 * 1536 * 5:
                    continue
                x = _x(t, k, gen)
                for j0, j1 in {(0, half), (min(1, half - 1), half), (half // 3, max(half // 3 + 1, half - 5))}:
                    lo, hi = LIB.strip(dtype, isa, arrays, k, n, x, j0, j1)
                    want_lo, want_hi, b_lo, b_hi = strip_reference(dtype, arrays, x, j0, j1)
                    what = f"{dtype} {isa} K={k} N={n} T={t} [{j0},{j1})"
                    _check(lo, want_lo, b_lo, what + " lo")
                    _check(hi, want_hi, b_hi, what + " hi")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_gets_the_same_bits_whatever_shares_the_call(dtype, isa):
    """T = 1 sweeps rows one by one and larger T works in row blocks: each column still adds its
    rows in k order, so a token's output has the same bits alone or among others (batching does
    not change a sequence's result)."""
    gen = torch.Generator().manual_seed(11 + DTYPES.index(dtype))
    small_k = 33 if dtype in ("fp32", "bf16") else 64
    for k, n in ((96, 2200), (2048, 1536), (small_k, 130)):
        arrays = _matrix(dtype, k, n, gen)
        x = torch.randn(5, k, generator=gen)
        for j0, j1 in ((0, n // 2), (3, n // 2 - 5)):
            lo1, hi1 = LIB.strip(dtype, isa, arrays, k, n, x[:1], j0, j1)
            for t in (2, 3, 5):
                lo, hi = LIB.strip(dtype, isa, arrays, k, n, x[:t], j0, j1)
                what = f"{dtype} {isa} K={k} N={n} [{j0},{j1}) T=1 vs T={t}"
                assert torch.equal(lo[0], lo1[0]) and torch.equal(hi[0], hi1[0]), what


@pytest.mark.parametrize("dtype", ("int4", "q8", "mxfp4"))
def test_vnni_strips_give_the_avx512_bits(dtype):
    """The VNNI strips (vpdpbusd; q8 at T = 1 sweeps quads of rows) compute the same exact int32
    group sums as the AVX-512 ones and combine them with the same float steps: equal bits, for
    decode and small batches, widths past the q8 sweep window (1024 columns), column tails, and
    the extreme codes (q8 -128 and 127, activations at +-127)."""
    if LIB is None or "avx512vnni" not in LIB.available_isas():
        pytest.skip("this CPU has no AVX-512 VNNI")
    gen = torch.Generator().manual_seed(23 + DTYPES.index(dtype))
    for k, n in ((64, 2200), (2048, 1536), (96, 130), (32, 64)):
        arrays = _matrix(dtype, k, n, gen)
        if dtype == "q8":
            qs = arrays[0].clone()
            qs[0, :] = -128  # the format holds -128 (a GGUF may have it); the quantiser never makes it
            qs[1, :] = 127
            arrays = (qs, *arrays[1:])
        x = _x(5, k, gen)
        x[:, 0] = 1e3  # saturates its group: xq = +-127 there
        x[1:, 1] = -1e3
        for j0, j1 in ((0, n // 2), (3, n // 2 - 5), (0, min(64, n // 2))):
            for t in (1, 2, 5):
                want = LIB.strip(dtype, "avx512", arrays, k, n, x[:t], j0, j1)
                got = LIB.strip(dtype, "avx512vnni", arrays, k, n, x[:t], j0, j1)
                what = f"{dtype} K={k} N={n} [{j0},{j1}) T={t}"
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), what


@pytest.mark.parametrize("dtype", ("bf16", "q8"))
def test_the_reused_work_buffer_does_not_leak_between_calls(dtype):
    """The pool keeps one work buffer across calls (grown when a call needs more): a small call after a
    big one, and a big one after a small one, give the bits of the same call in a fresh pool. Tokens
    that share experts share the once-per-token int8 activations: each must still see its own."""
    if LIB is None:
        pytest.skip("native CPU kernels not built")
    from moed.kernels.native_cpu import NativeCpu, descriptor_of

    bank = _bank(dtype, "silu", False, d=256, inter=320)
    desc = descriptor_of(bank)
    gen = torch.Generator().manual_seed(9)
    calls = []
    for tokens, top_k in ((16, 4), (1, 2), (16, 4), (3, 1)):
        x = torch.randn(tokens, bank.hidden_size, generator=gen) * (1 + torch.arange(tokens)).view(-1, 1)
        ids = torch.randint(0, bank.num_slots, (tokens, top_k), generator=gen, dtype=torch.int32)
        ids[:, 0] = 0  # every token through expert 0: its rows come from different tokens
        calls.append((x, ids, torch.rand(tokens, top_k, generator=gen)))
    got = [LIB.moe(desc, *c) for c in calls]
    for c, g in zip(calls, got):
        fresh = NativeCpu(LIB.path, num_threads=2)
        try:
            assert torch.equal(fresh.moe(desc, *c), g)
        finally:
            fresh.close()


def test_torch_gets_huge_pages_for_large_allocations_unless_told_not_to():
    code = "import moed, os; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "THP_MEM_ALLOC_ENABLE": "0"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_thread_count(dtype):
    """Each matrix is cut into row blocks by its shape alone and the blocks are added in order, so
    one thread or several give the same bits (and so do the executors, whatever they run beside)."""
    if LIB is None:
        pytest.skip("native CPU kernels not built")
    from moed.kernels.native_cpu import NativeCpu, descriptor_of

    single = NativeCpu(LIB.path, num_threads=1)
    try:
        bank = _bank(dtype, "silu", False, d=256, inter=320)
        desc = descriptor_of(bank)
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(4, bank.hidden_size, generator=gen)
        ids = torch.randint(0, bank.num_slots, (4, 3), generator=gen, dtype=torch.int32)
        w = torch.rand(4, 3, generator=gen)
        assert torch.equal(single.moe(desc, x, ids, w), LIB.moe(desc, x, ids, w))
        dense = torch.randn(300, 256, generator=gen).bfloat16()
        assert torch.equal(single.dense_bf16(x, dense), LIB.dense_bf16(x, dense))
    finally:
        single.close()


@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (130, 33), (48, 2048), (2048, 100), (3000, 64), (7, 96)])
def test_dense_bf16_matches_float64(shape, isa):
    gen = torch.Generator().manual_seed(shape[0])
    n, k = shape
    w = torch.randn(n, k, generator=gen).bfloat16()
    for t in (1, 2, 3, 5, 16):
        x = torch.randn(t, k, generator=gen)
        got = LIB.dense_bf16(x, w)
        want = x.double() @ w.double().T
        _check(got, want, x.double().abs() @ w.double().abs().T, f"dense {n}x{k} T={t} {isa}")


@pytest.mark.parametrize("k", [33, 2048])
def test_dense_bf16_many_is_separate_calls_bit_for_bit(k, isa):
    """q, k and v in one call: x prepared once, rows of all three shared out; same bits as one by one."""
    gen = torch.Generator().manual_seed(k)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for n in (300, 17, 40)]
    for t in (1, 3):
        x = torch.randn(t, k, generator=gen)
        many = LIB.dense_bf16_many(x, weights)
        assert [tuple(y.shape) for y in many] == [(t, 300), (t, 17), (t, 40)]
        for got, w in zip(many, weights):
            assert torch.equal(got, LIB.dense_bf16(x, w))
            _check(got, x.double() @ w.double().T, x.double().abs() @ w.double().abs().T, f"many {k} T={t} {isa}")
    with pytest.raises(ValueError, match="1 to 8"):
        LIB.dense_bf16_many(x, [])
    with pytest.raises(ValueError, match="contiguous bf16"):
        LIB.dense_bf16_many(x, [weights[0], weights[1].float()])


@pytest.mark.parametrize("dtype", ["q8", "int4"])
@pytest.mark.parametrize("shape", [(1, 32), (5, 96), (131, 288), (64, 2048), (520, 256)])  # N, K
def test_rows_kernels_match_their_twin(dtype, shape, isa):
    """The rows-layout GEMV (dense projections of a quantised GGUF) against the k-major twin on the
    same numbers: K with group counts that are not multiples of 8, odd N, T from 1 to 16."""
    from moed.kernels.rows_format import rows_from_kn, rows_to_kn

    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    n_even = n + n % 2  # the k-major formats pair columns; the rows layout does not need it
    arrays = rows_from_kn(dtype, _matrix(dtype, k, n_even, gen))
    arrays = tuple(t[:n].contiguous() for t in arrays)
    kn = rows_to_kn(dtype, tuple(torch.cat([t, t[:n_even - n]]) for t in arrays))
    for t in (1, 2, 7, 16):
        x = torch.randn(t, k, generator=gen)
        x[:, 3] = 0.0
        (got,) = LIB.rows_many(dtype, [arrays], x)
        want, bound = matrix_product(dtype, kn, x)
        err = (got.double() - want[:, :n]).abs()
        assert bool((err <= 1e-5 * bound[:, :n] + 1e-30).all()), f"rows {dtype} {shape} T={t} {isa}: {float(err.max())}"


@pytest.mark.parametrize("dtype", ["q8", "int4"])
def test_rows_to_bf16_is_the_torch_dequantisation_bit_for_bit(dtype):
    """Prefill dequantises each quantised projection per chunk: the native one must be the reference."""
    from moed.kernels.rows_format import dequantize_rows, rows_from_kn

    gen = torch.Generator().manual_seed(2)
    arrays = rows_from_kn(dtype, _matrix(dtype, 96, 70, gen))
    got = LIB.rows_to_bf16(dtype, arrays, 96)
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == (70, 96)
    assert torch.equal(got, dequantize_rows(dtype, arrays, torch.bfloat16))
    assert torch.equal(LIB.rows_to_f32(dtype, arrays, 96), dequantize_rows(dtype, arrays, torch.float32))
    with pytest.raises(ValueError, match="contiguous host arrays"):
        LIB.rows_to_bf16(dtype, arrays, 64)
    with pytest.raises(ValueError, match="rows_to_f32: .* contiguous host arrays"):
        LIB.rows_to_f32(dtype, arrays, 64)


def _fp8_rows(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled FP8 matrix in the rows layout: every e4m3 code but NaN occurs, scales spread widely."""
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int64).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    scale = torch.exp2(torch.randint(-12, 4, (n, k // 128), generator=gen).float()) * (1 + torch.rand(n, k // 128, generator=gen))
    return codes.contiguous(), scale.contiguous()


@pytest.mark.parametrize("shape", [(1, 128), (37, 384), (64, 2048), (130, 256)])  # N, K
def test_fp8_rows_match_their_twin(shape, isa):
    """Block-scaled FP8 rows (a DeepSeek FP8 checkpoint's linears kept as stored) against the torch twin's
    dequantisation in float64: odd N, T from 1 to 16, on every ISA."""
    from moed.kernels.rows_format import dequantize_rows

    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    arrays = _fp8_rows(n, k, gen)
    w = dequantize_rows("fp8", arrays).double()
    for t in (1, 2, 7, 16):
        x = torch.randn(t, k, generator=gen)
        (got,) = LIB.rows_many("fp8", [arrays], x)
        want = x.double() @ w.t()
        bound = x.double().abs() @ w.abs().t()
        err = (got.double() - want).abs()
        assert bool((err <= 1e-5 * bound + 1e-30).all()), f"fp8 {shape} T={t} {isa}: {float((err / bound).max())}"


def test_fp8_rows_to_bf16_is_the_torch_dequantisation_bit_for_bit():
    from moed.kernels.rows_format import dequantize_rows

    arrays = _fp8_rows(70, 256, torch.Generator().manual_seed(4))
    got = LIB.rows_to_bf16("fp8", arrays, 256)
    assert torch.equal(got, dequantize_rows("fp8", arrays, torch.bfloat16))
    assert torch.equal(LIB.rows_to_f32("fp8", arrays, 256), dequantize_rows("fp8", arrays, torch.float32))
    with pytest.raises(ValueError, match="contiguous host arrays"):
        LIB.rows_to_bf16("fp8", arrays, 128)


def test_rows_many_checks_its_arrays():
    from moed.kernels.rows_format import rows_from_kn

    gen = torch.Generator().manual_seed(1)
    arrays = rows_from_kn("q8", _matrix("q8", 64, 8, gen))
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="contiguous host arrays"):
        LIB.rows_many("q8", [arrays], torch.randn(1, 96))  # K of x does not match
    with pytest.raises(ValueError, match="contiguous host arrays"):
        LIB.rows_many("int4", [arrays], x)
    with pytest.raises(ValueError, match="q8, int4 or fp8"):
        LIB.rows_many("bf16", [arrays], x)


def _bank(dtype: str, kind: str, bias: bool, d: int = 96, inter: int = 160, layers: int = 2, experts: int = 6):
    gen = torch.Generator().manual_seed(11)
    n = layers * experts
    extra = {}
    if bias:
        extra = dict(gate_up_bias=torch.randn(n, 2 * inter, generator=gen), down_bias=torch.randn(n, d, generator=gen))
    return build_expert_bank(torch.randn(n, d, 2 * inter, generator=gen) / d**0.5 * 3,
                             torch.randn(n, inter, d, generator=gen) / inter**0.5,
                             num_moe_layers=layers, num_experts=experts, dtype=dtype,
                             activation=ExpertActivation(kind), **extra)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,bias", [("silu", False), ("gpt_oss", True), ("clamped_silu", False), ("relu2", False),
                                       ("gelu_tanh", True)])
def test_moe_call_matches_the_twin_and_its_own_per_slot_outputs(dtype, kind, bias, isa):
    from moed.experts.executor import merge_expert_outputs
    from moed.experts.expert_ffn import run_expert

    bank = _bank(dtype, kind, bias)
    desc_gen = torch.Generator().manual_seed(3)
    from moed.kernels.native_cpu import descriptor_of

    desc = descriptor_of(bank)
    for tokens, top_k in ((1, 4), (3, 2), (16, 3)):
        x = torch.randn(tokens, bank.hidden_size, generator=desc_gen)
        ids = torch.randint(0, bank.num_slots, (tokens, top_k), generator=desc_gen, dtype=torch.int32)
        ids[0, -1] = ids[0, 0] if top_k > 1 else ids[0, 0]  # a repeated expert within one token
        w = torch.rand(tokens, top_k, generator=desc_gen)
        per_slot = torch.empty(tokens, top_k, bank.hidden_size)
        y = LIB.moe(desc, x, ids, w, per_slot=per_slot)
        want, tol = routed_reference(bank, x, ids, w)
        err = (y.double() - want).abs()
        assert float((err / (tol + 1e-30)).max()) <= 1.0, f"{dtype} {kind} {isa} T={tokens}"
        # the merge is the executor contract's, bit for bit
        assert torch.equal(y, merge_expert_outputs(per_slot, w))
        # one expert alone gives the same bits as among others
        fid = int(ids[tokens - 1, 0])
        rows = (ids == fid).nonzero()
        alone = run_expert(bank, fid, x[rows[:, 0]].contiguous())
        assert torch.equal(alone, per_slot[rows[:, 0], rows[:, 1]])


def test_moe_skips_slots_marked_minus_one_and_refuses_bad_ids():
    if LIB is None:
        pytest.skip("native CPU kernels not built")
    from moed.kernels.native_cpu import descriptor_of

    bank = _bank("int4", "silu", False)
    desc = descriptor_of(bank)
    x = torch.randn(2, bank.hidden_size)
    ids = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.5], [1.0, 1.0]])
    per_slot = torch.full((2, 2, bank.hidden_size), 7.0)
    y = LIB.moe(desc, x, ids, w, per_slot=per_slot)
    assert torch.equal(y[1], torch.zeros(bank.hidden_size)), "a token with no slot run gets zeros"
    assert torch.equal(per_slot[0, 1], torch.full((bank.hidden_size,), 7.0)), "an unrun slot is not written"
    assert torch.equal(y[0], per_slot[0, 0] * 0.5)
    with pytest.raises(ValueError, match="out of range"):
        LIB.moe(desc, x, torch.tensor([[bank.num_slots, 0], [0, 0]], dtype=torch.int32), w)
    with pytest.raises(ValueError, match="out of range"):  # -1 is "not run here", below it is an error
        LIB.moe(desc, x, torch.tensor([[-2, 0], [0, 0]], dtype=torch.int32), w)


def test_without_the_library_the_numba_kernels_run_and_say_so():
    code = ("from moed.kernels.native_cpu import native, native_status; import torch;"
            "from moed.experts.cpu_executor import CpuExecutor;"
            "from moed.cache.bank_builder import build_expert_bank; from moed.cache.host_bank import ExpertActivation;"
            "b = build_expert_bank(torch.randn(4, 64, 64), torch.randn(4, 32, 64), num_moe_layers=1, num_experts=4,"
            " dtype='int4', activation=ExpertActivation());"
            "y = CpuExecutor(b).run(0, torch.randn(2, 64), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2) / 2);"
            "assert native() is None and y.shape == (2, 64) and bool(torch.isfinite(y).all());"
            "print(native_status())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MOED_NATIVE": "0"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("numba (native kernels unavailable: disabled by MOED_NATIVE=0)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_call_on_matrices_cut_into_several_row_blocks(dtype, isa):
    """Real expert shapes (SmolLM2's 576 x 1536 and Qwen3-30B-A3B's 2048 x 768): each matrix is cut
    into several row blocks whose partial sums (and the down blocks' own activations) must add up."""
    from moed.kernels.native_cpu import descriptor_of

    for d, inter in ((576, 1536), (2048, 768)):
        gen = torch.Generator().manual_seed(d)
        bank = build_expert_bank(torch.randn(4, d, 2 * inter, generator=gen) / d**0.5,
                                 torch.randn(4, inter, d, generator=gen) / inter**0.5,
                                 num_moe_layers=1, num_experts=4, dtype=dtype, activation=ExpertActivation())
        x = torch.randn(2, d, generator=gen)
        ids = torch.tensor([[0, 1], [1, 3]], dtype=torch.int32)
        w = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
        y = LIB.moe(descriptor_of(bank), x, ids, w)
        want, tol = routed_reference(bank, x, ids, w)
        assert float(((y.double() - want).abs() / tol).max()) <= 1.0, (dtype, isa, d, inter)


@pytest.mark.parametrize("value", ["x", "0", "-2", "1.5"])
def test_a_bad_thread_count_is_refused_by_name(value, monkeypatch):
    from moed.kernels.cpu_threads import cpu_threads, usable_cores

    monkeypatch.setenv("MOED_CPU_THREADS", value)
    with pytest.raises(ValueError, match="MOED_CPU_THREADS"):
        cpu_threads()
    monkeypatch.setenv("MOED_CPU_THREADS", "3")
    assert cpu_threads() == 3
    monkeypatch.delenv("MOED_CPU_THREADS")
    assert cpu_threads() == usable_cores() >= 1


def test_an_unknown_isa_falls_back_to_numba_and_says_why():
    code = "from moed.kernels.native_cpu import native, native_status; assert native() is None; print(native_status())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MOED_NATIVE_ISA": "sse9"},
                         capture_output=True, text=True, timeout=300)
    if LIB is None:
        pytest.skip("native CPU kernels not built")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MOED_NATIVE_ISA='sse9' is not one of scalar, avx2, avx512, avx512vnni" in out.stdout


@needs_lib
def test_the_vector_width_is_the_cpus_unless_told():
    """moed_cpu_vector_bits: 256 on AMD family 0x19 (512-bit instructions split in two), 512 elsewhere;
    MOED_VECTOR_BITS=256|512 overrides it for the process and anything else is ignored."""
    code = ("import moed; from moed.kernels.native_cpu import native, native_status; n = native(); "
            "print(n.vector_bits, native_status())")
    env = {k: v for k, v in os.environ.items() if k != "MOED_VECTOR_BITS"}

    def width(value: str | None) -> tuple[int, str]:
        run_env = env if value is None else {**env, "MOED_VECTOR_BITS": value}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        bits, status = out.stdout.strip().split(" ", 1)
        return int(bits), status

    with open("/proc/cpuinfo") as f:
        info = f.read()
    amd_zen34 = "AuthenticAMD" in info and "\ncpu family\t: 25\n" in info
    assert width(None)[0] == (256 if amd_zen34 else 512)
    assert width("512")[0] == 512 and width("bogus")[0] == width(None)[0]
    bits, status = width("256")
    assert bits == 256
    assert ("256-bit GGUF kernels" in status) == LIB.isa.startswith("avx512")
