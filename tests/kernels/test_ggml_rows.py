"""The GGUF block-row kernels (native/cpu/ggml_rows.c) against their torch twin on gguf.quants-decoded
rows (kernels/ggml_rows_format.py), for every type the ggml bank keeps, every ISA the CPU has, odd
shapes and several tokens (issue #31)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import random_blocks
from moed.kernels.ggml_rows_format import GGUF_ROW_TYPES, ROW_TYPES, act_span, dequantize_rows, row_bytes, rows_product_reference
from moed.kernels.native_cpu import native
from moed.kernels.native_cpu_reference import quantize_activations
from moed.kernels import gguf_quants as q

TYPES = [T(t) for t in GGUF_ROW_TYPES]  # moed's own FP8 types: tests/kernels/test_fp8_block_rows.py


def _rows(qtype: T, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    data = random_blocks(qtype, (rows, k), np.random.default_rng(seed))
    if qtype == T.MXFP4:  # exponents near 2^0, as real files have (random ones overflow float32)
        data = data.reshape(-1, 17)
        data[:, 0] = np.random.default_rng(seed).integers(118, 130, size=data.shape[0])
    return torch.from_numpy(np.ascontiguousarray(data).reshape(rows, -1))


def _lib():
    lib = native()
    if lib is None:
        pytest.skip("the native CPU kernels are not built")
    return lib


def test_the_kept_types_and_their_row_sizes():
    assert {q.type_name(t) for t in GGUF_ROW_TYPES} == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                                                       "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4"}
    assert set(ROW_TYPES) - set(GGUF_ROW_TYPES) == set(q.MOED_TYPES)
    for t in TYPES:
        weights, size = GGML_QUANT_SIZES[t]
        assert row_bytes(int(t), 3 * weights) == 3 * size
    with pytest.raises(ValueError, match="Q4_K rows need a multiple of 256 weights"):
        row_bytes(int(T.Q4_K), 128)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_isa_matches_the_torch_twin(qtype):
    lib = _lib()
    weights = GGML_QUANT_SIZES[qtype][0]
    # several blocks, an odd count of 32-groups; for the 32-weight types also whole runs of eight
    # blocks (the AVX-512 kernels' step) with and without a remainder
    for k in (3 * weights,) if weights == 256 else (5 * weights, 6 * weights, 7 * weights, 16 * weights, 19 * weights):
        raw = _rows(qtype, 5, k)
        x = torch.randn(3, k) * torch.linspace(0.1, 3.0, k)
        want, bound = rows_product_reference(raw, int(qtype), k, x)
        xq, xs, xsum = quantize_activations(x, act_span(qtype))
        for isa in lib.available_ggml_isas():
            got = torch.stack([lib.ggml_dot_one(int(qtype), isa, raw[r], xq, xs, xsum.float()) for r in range(5)],
                              dim=1)
            err = (got.double() - want).abs()
            assert bool((err <= 1e-5 * bound + 1e-30).all()), (k, isa, float((err / bound).max()))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_256_bit_vnni_kernels_give_the_avx2_kernels_floats(qtype):
    """ggml_rows_avx2vnni.c is ggml_rows_avx2.c with vpdpbusd / vpdpwssd for maddubs + madd: the same integer
    sums in the same float order, so the same bits; at AVX-512 VNNI the CPU's vector width picks a set."""
    lib = _lib()
    if "avx512vnni256" not in lib.available_ggml_isas():
        pytest.skip("the CPU has no AVX-512 VNNI")
    assert lib.vector_bits in (256, 512)
    weights = GGML_QUANT_SIZES[qtype][0]
    k = (3 if weights == 256 else 19) * weights
    raw = _rows(qtype, 4, k, seed=3)
    xq, xs, xsum = quantize_activations(torch.randn(3, k) * 2, act_span(qtype))

    def run(isa: str) -> torch.Tensor:
        return torch.stack([lib.ggml_dot_one(int(qtype), isa, raw[r], xq, xs, xsum.float()) for r in range(4)])

    narrow = run("avx512vnni256")
    assert torch.equal(narrow, run("avx2"))
    wide_anyway = qtype in (T.Q6_K, T.NVFP4)  # their 512-bit kernels stay ahead on a split-512 CPU
    chosen = "avx512vnni256" if lib.vector_bits == 256 and not wide_anyway else "avx512vnni512"
    assert torch.equal(run("avx512vnni"), run(chosen))


def test_mxfp4_scales_at_the_bottom_of_the_range():
    """E8M0 exponents 0 and 1 are subnormal floats (2^-128, 2^-127): every ISA reads them exactly."""
    lib = _lib()
    k = 19 * 32
    raw = _rows(T.MXFP4, 5, k).reshape(-1, 17).clone()
    raw[:, 0] = torch.arange(raw.shape[0]) % 4  # exponents 0, 1, 2, 3
    raw = raw.reshape(5, -1)
    x = torch.randn(2, k) * 1e30  # products of normal size
    want, bound = rows_product_reference(raw, int(T.MXFP4), k, x)
    assert float(bound.min()) > 0
    xq, xs, xsum = quantize_activations(x)
    for isa in lib.available_ggml_isas():
        got = torch.stack([lib.ggml_dot_one(int(T.MXFP4), isa, raw[r], xq, xs, xsum.float()) for r in range(5)], dim=1)
        assert bool(((got.double() - want).abs() <= 1e-5 * bound).all()), isa


def _nvfp4_every_scale_byte(rows: int, k: int) -> torch.Tensor:
    """NVFP4 rows whose scale bytes run through all 256 values: zero, subnormals, 0x7F (NaN: reads as 0),
    bit 7 set (ignored, so 0xFF is 240) and the largest."""
    raw = _rows(T.NVFP4, rows, k).reshape(-1, 36).clone()
    raw[:, 0:4] = (torch.arange(raw.shape[0] * 4) % 256).to(torch.uint8).view(-1, 4)
    return raw.reshape(rows, -1)


def test_nvfp4_scales_of_every_byte_value():
    """Every scale byte reads as gguf.quants reads it, in the twin and in every ISA's kernel."""
    import gguf

    lib = _lib()
    k = 7 * 64
    raw = _nvfp4_every_scale_byte(10, k)  # 280 blocks: every byte value at least once
    ref = gguf.quants.dequantize(raw.numpy(), T.NVFP4)
    assert torch.equal(dequantize_rows(raw, int(T.NVFP4), k), torch.from_numpy(np.asarray(ref, dtype=np.float32)))
    x = torch.randn(2, k)
    want, bound = rows_product_reference(raw, int(T.NVFP4), k, x)
    xq, xs, xsum = quantize_activations(x)
    for isa in lib.available_ggml_isas():
        got = torch.stack([lib.ggml_dot_one(int(T.NVFP4), isa, raw[r], xq, xs, xsum.float()) for r in range(10)], dim=1)
        assert bool(((got.double() - want).abs() <= 1e-5 * bound + 1e-30).all()), isa
    assert torch.equal(lib.ggml_to_bf16(raw, int(T.NVFP4), k), dequantize_rows(raw, int(T.NVFP4), k).bfloat16())


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.IQ4_XS], ids=lambda t: t.name)
def test_several_matrices_in_one_call_on_the_pool(qtype):
    lib = _lib()
    k = 512
    mats = [(_rows(qtype, n, k, seed=n), int(qtype)) for n in (1, 33, 70)]
    x = torch.randn(2, k)
    for (raw, t), y in zip(mats, lib.ggml_rows(mats, x)):
        want, bound = rows_product_reference(raw, t, k, x)
        assert y.shape == (2, raw.shape[0])
        assert bool(((y.double() - want).abs() <= 1e-5 * bound + 1e-30).all())


def test_the_k_quants_take_one_activation_scale_per_super_block():
    lib = _lib()
    assert {q.type_name(t) for t in TYPES if act_span(t) == 256} == {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    for t in TYPES:
        assert lib.ggml_act_span(int(t)) == act_span(t), t.name
    x = torch.randn(2, 512) * torch.linspace(0.1, 3.0, 512)
    xq, xs, xsum = quantize_activations(x, 256)
    assert torch.equal(xs[:, :8], xs[:, :1].expand(2, 8)) and not torch.equal(xs[:, 7], xs[:, 8])
    assert torch.equal(xq.view(2, 2, 256).abs().amax(-1).to(torch.int32), torch.full((2, 2), 127, dtype=torch.int32))
    # a call on several matrices quantises once with the largest span: the 32-weight rows take it too
    mats = [(_rows(T.Q4_K, 9, 512, seed=1), int(T.Q4_K)), (_rows(T.Q8_0, 5, 512, seed=2), int(T.Q8_0)),
            (_rows(T.IQ4_NL, 3, 512, seed=3), int(T.IQ4_NL))]
    for (raw, t), y in zip(mats, lib.ggml_rows(mats, x)):
        want, bound = rows_product_reference(raw, t, 512, x, span=256)
        assert bool(((y.double() - want).abs() <= 1e-5 * bound).all()), q.type_name(t)
        if t != int(T.Q4_K):  # with its own span the twin is another product
            other, _ = rows_product_reference(raw, t, 512, x)
            assert not bool(((y.double() - other).abs() <= 1e-5 * bound).all())


def test_the_twin_reads_what_gguf_decodes():
    raw = _rows(T.Q5_K, 4, 256)
    import gguf

    ref = gguf.quants.dequantize(raw.numpy(), T.Q5_K)
    assert torch.equal(dequantize_rows(raw, int(T.Q5_K), 256), torch.from_numpy(np.asarray(ref, dtype=np.float32)))


def test_bad_rows_are_refused():
    lib = _lib()
    with pytest.raises(ValueError, match="uint8 \\[rows, 144\\]"):
        lib.ggml_rows([(torch.zeros(2, 143, dtype=torch.uint8), int(T.Q4_K))], torch.zeros(1, 256))
    with pytest.raises(ValueError, match="the ggml bank keeps .* not IQ2_XXS"):
        lib.ggml_rows([(torch.zeros(2, 66, dtype=torch.uint8), int(T.IQ2_XXS))], torch.zeros(1, 256))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_decode_to_bf16_and_f32_as_gguf_decodes_them(qtype):
    """The prefill GEMMs' weights: gguf's decoded values in float32 (CPUs without bf16 GEMMs) and rounded to
    bf16 once, bit for bit (the AVX2 decoders of the common types and the scalar one of the rest)."""
    lib = _lib()
    weights = GGML_QUANT_SIZES[qtype][0]
    k = 2 * weights if weights == 256 else 5 * weights
    raw = _rows(qtype, 7, k, seed=4)
    want = dequantize_rows(raw, int(qtype), k)
    assert torch.equal(lib.ggml_to_bf16(raw, int(qtype), k), want.bfloat16())
    got = lib.ggml_to_f32(raw, int(qtype), k)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_many_tokens_in_one_call_are_each_the_one_token_result(qtype):
    """A prefill call multiplies each row with many tokens, and the kernels take them several at a time (Q6_K: four,
    sharing each group's decoded codes): every token's output is bit for bit its one-token call's, at every count
    from 1 to 9 (whole tiles and every tail), on every ISA."""
    lib = _lib()
    weights = GGML_QUANT_SIZES[qtype][0]
    k = 2 * weights if weights == 256 else 5 * weights
    raw = _rows(qtype, 2, k, seed=9)
    x = torch.randn(9, k) * torch.linspace(0.1, 3.0, k)
    xq, xs, xsum = quantize_activations(x, act_span(qtype))
    xsum = xsum.float()
    want, bound = rows_product_reference(raw, int(qtype), k, x)
    for isa in lib.available_ggml_isas():
        for r in range(2):
            one = torch.cat([lib.ggml_dot_one(int(qtype), isa, raw[r], xq[t:t + 1], xs[t:t + 1], xsum[t:t + 1])
                             for t in range(9)])
            assert bool(((one.double() - want[:, r]).abs() <= 1e-5 * bound[:, r] + 1e-30).all()), isa
            for n in range(2, 10):
                many = lib.ggml_dot_one(int(qtype), isa, raw[r], xq[:n], xs[:n], xsum[:n])
                assert torch.equal(many, one[:n]), (isa, r, n)
