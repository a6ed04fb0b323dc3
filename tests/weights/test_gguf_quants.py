"""GGML block formats: moed's torch decoders and bank repacks against gguf-py's numpy reference.

``dequantize`` is compared bit for bit with ``gguf.quants.dequantize`` for every type, the
K-quants included (within float32 rounding would be the most one could ask of them, but every
product in their formulas is exact in float32, so the results are identical). Inputs the
reference can make come from ``gguf.quants.quantize``; K-quant blocks are random bytes with
finite fp16 ``d``/``dmin`` fields.

Speed, one 16-expert chunk of Qwen3-30B-A3B ([16, 768, 2048], 25M weights) on 2 threads (Zen 3
EPYC, shared machine): dequantize Q4_K 0.06 s, Q5_K 0.10 s, Q6_K 0.08 s, Q8_0 0.03 s, MXFP4 0.14 s,
each peaking at about the float32 output (96 MB) plus 5 MB; the bank repacks take 0.02-0.04 s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as ref_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

from moed.kernels import gguf_quants as gq

EXPERT_SHAPE = (4, 64, 512)  # [E, rows, K], K holding two K-quant super-blocks per row
SHAPES = [EXPERT_SHAPE, (96, 256), (3, 256), (512,), (2, 3, 2, 256)]
QUANTISABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4]
# types gguf cannot quantise (or not quickly): random bytes with finite fp16 scales instead
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.NVFP4]
FP16_FIELDS = {T.Q4_K: [(0, 2), (2, 4)], T.Q5_K: [(0, 2), (2, 4)], T.Q6_K: [(208, 210)], T.Q2_K: [(80, 82), (82, 84)],
               T.Q3_K: [(108, 110)], T.IQ4_NL: [(0, 2)], T.IQ4_XS: [(0, 2)],
               T.NVFP4: []}  # NVFP4: every byte is a valid E4M3 scale


def _torch_bytes(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).reshape(-1).copy())


def _quantised(qtype: T, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """gguf's own quantisation of random weights: ``uint8 [..., bytes per row]`` (F32/F16: typed)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.3
    return ref_quants.quantize(x, qtype)


def _random_k_blocks(qtype: T, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random K-quant bytes ``uint8 [..., bytes per row]`` whose fp16 scale fields are finite."""
    rng = np.random.default_rng(seed)
    elems, size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // elems
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for lo, hi in FP16_FIELDS[qtype]:
        blocks[:, lo:hi] = (rng.standard_normal((n_blocks, 1)) * 0.05).astype(np.float16).view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // elems * size)


def _source(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return _random_k_blocks(qtype, shape, seed) if qtype in K_QUANTS else _quantised(qtype, shape, seed)


def _reference(data: np.ndarray, qtype: T) -> np.ndarray:
    with np.errstate(over="ignore"):  # MXFP4 with the largest exponents overflows float32, as in ggml
        return np.asarray(ref_quants.dequantize(data, qtype), dtype=np.float32)


def _bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", QUANTISABLE + K_QUANTS, ids=lambda t: t.name)
def test_dequantize_matches_reference_bit_for_bit(qtype: T, shape: tuple[int, ...]) -> None:
    data = _source(qtype, shape)
    out = gq.dequantize(_torch_bytes(data), int(qtype), shape)
    assert out.dtype == torch.float32 and tuple(out.shape) == shape
    ref = _reference(data, qtype).reshape(shape)
    assert np.array_equal(_bits(out), _bits(ref))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_keep_every_bit_pattern(qtype: T) -> None:
    """Random bytes: subnormals, infinities and NaNs included (torch quiets a signalling fp16 NaN where
    numpy keeps its payload, so NaNs are compared as NaNs)."""
    n = 4096
    data = np.random.default_rng(1).integers(0, 256, n * GGML_QUANT_SIZES[qtype][1], dtype=np.uint8)
    out = gq.dequantize(torch.from_numpy(data.copy()), int(qtype), (8, n // 8))
    typed = data.view({T.F32: np.float32, T.F16: np.float16, T.BF16: np.uint16}[qtype])
    want = (typed.astype(np.uint32) << 16).view(np.float32) if qtype == T.BF16 else typed.astype(np.float32)
    got = out.numpy().reshape(-1)
    assert np.isnan(want).any() and np.array_equal(np.isnan(got), np.isnan(want))
    number = ~np.isnan(want)
    assert np.array_equal(_bits(got[number]), _bits(want[number]))


def test_mxfp4_extreme_exponents_match_reference() -> None:
    """Every e8m0 ggml can mean (0..254; 255 is NaN in OCP MX), subnormal and infinite results included."""
    data = _quantised(T.MXFP4, (16, 512), seed=2).reshape(-1, 17)
    data[:, 0] = np.arange(data.shape[0]) % 255
    out = gq.dequantize(_torch_bytes(data), int(T.MXFP4), (16, 512))
    ref = _reference(data.reshape(16, -1), T.MXFP4)
    assert np.isinf(ref).any() and (np.abs(ref[ref != 0]) < np.finfo(np.float32).tiny).any()
    assert np.array_equal(_bits(out), _bits(ref))


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_dequantize_reads_a_misaligned_slice(qtype: T) -> None:
    """A reader slices tensors out of one mmap: the bytes may start at an odd address."""
    data = _source(qtype, (8, 256))
    raw = _torch_bytes(data)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), raw])[1:]
    assert shifted.storage_offset() == 1
    out = gq.dequantize(shifted, int(qtype), (8, 256))
    assert np.array_equal(_bits(out), _bits(_reference(data, qtype)))


def test_dequantize_slices_a_large_tensor_seamlessly() -> None:
    """More blocks than one decode slice: every slice lands where it belongs."""
    shape = (3, gq.DEQUANT_SLICE // 256 + 7, 256)
    data = _source(T.Q4_K, shape, seed=3)
    out = gq.dequantize(_torch_bytes(data), int(T.Q4_K), shape)
    assert np.array_equal(_bits(out), _bits(_reference(data, T.Q4_K)))


def test_block_sizes_and_names_match_gguf() -> None:
    for qtype, size in GGML_QUANT_SIZES.items():
        assert gq.block_size(int(qtype)) == size, qtype.name
        assert gq.type_name(int(qtype)) == qtype.name
    assert gq.type_name(99) == "type 99"
    assert set(gq.SUPPORTED_TYPES) == {int(t) for t in QUANTISABLE + K_QUANTS}


def test_nbytes() -> None:
    assert gq.nbytes(int(T.Q4_K), (128, 768, 2048)) == 128 * 768 * 8 * 144
    assert gq.nbytes(int(T.F32), (5, 3)) == 60
    assert gq.nbytes(int(T.MXFP4), (2, 64)) == 2 * 2 * 17
    assert gq.nbytes(int(T.IQ2_XXS), (4, 256)) == 4 * 66  # sizes are known for types moed cannot read
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        gq.nbytes(int(T.Q6_K), (4, 128))
    with pytest.raises(ValueError, match="non-negative ints"):
        gq.nbytes(int(T.Q8_0), ())


def test_types_only_gguf_decodes_go_through_it() -> None:
    assert {"IQ2_XXS", "IQ3_S", "IQ1_M", "TQ2_0"} <= {gq.type_name(t) for t in gq.decoded_types()}
    rng = np.random.default_rng(0)
    for qtype in (T.IQ2_XXS, T.IQ3_S):
        blocks = rng.integers(0, 256, size=(5, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        blocks[:, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
        got = gq.dequantize(torch.from_numpy(blocks.reshape(-1)), int(qtype), (5, 256))
        assert np.array_equal(got.numpy(), ref_quants.dequantize(blocks, qtype).reshape(5, 256))


def test_unsupported_type_names_it_and_the_supported_ones() -> None:
    with pytest.raises(gq.UnsupportedGgufType) as info:
        gq.dequantize(torch.zeros(292, dtype=torch.uint8), int(T.Q8_K), (256,))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "Q8_K" in message and all(gq.type_name(t) in message for t in gq.SUPPORTED_TYPES + gq.decoded_types())
    with pytest.raises(gq.UnsupportedGgufType, match="type 99"):
        gq.dequantize(torch.zeros(4, dtype=torch.uint8), 99, (1,))
    with pytest.raises(gq.UnsupportedGgufType, match="type 99"):
        gq.block_size(99)
    with pytest.raises(gq.UnsupportedGgufType, match="IQ3_S"):
        gq.to_int4_bank(torch.zeros(110, dtype=torch.uint8), int(T.IQ3_S), (1, 1, 256))


def test_wrong_byte_count_names_expected_and_got() -> None:
    with pytest.raises(ValueError, match=r"needs 144 bytes, got 143"):
        gq.dequantize(torch.zeros(143, dtype=torch.uint8), int(T.Q4_K), (1, 256))
    with pytest.raises(ValueError, match=r"needs 68 bytes, got 69"):
        gq.to_q8_bank(torch.zeros(69, dtype=torch.uint8), int(T.Q8_0), (1, 2, 32))
    with pytest.raises(ValueError, match="1-D uint8"):
        gq.dequantize(torch.zeros(36, dtype=torch.int8), int(T.Q8_0), (32,))


def test_bank_repacks_refuse_wrong_types_and_shapes() -> None:
    with pytest.raises(ValueError, match="to_q8_bank takes Q8_0 .* got Q4_0"):
        gq.to_q8_bank(torch.zeros(18, dtype=torch.uint8), int(T.Q4_0), (1, 1, 32))
    with pytest.raises(ValueError, match="to_int4_bank takes Q4_0, Q4_1, Q4_K .* got MXFP4"):
        gq.to_int4_bank(torch.zeros(34, dtype=torch.uint8), int(T.MXFP4), (1, 2, 32))
    with pytest.raises(ValueError, match="odd row count 3"):
        gq.to_mxfp4_bank(torch.zeros(51, dtype=torch.uint8), int(T.MXFP4), (1, 3, 32))
    nan_exponent = _quantised(T.MXFP4, (1, 2, 64), seed=7).reshape(-1, 17)
    nan_exponent[3, 0] = 255
    with pytest.raises(ValueError, match="e8m0 exponent 255"):
        gq.to_mxfp4_bank(_torch_bytes(nan_exponent), int(T.MXFP4), (1, 2, 64))
    with pytest.raises(ValueError, match="must be 3-D"):
        gq.to_q8_bank(torch.zeros(34, dtype=torch.uint8), int(T.Q8_0), (1, 32))


def _reference_kn(data: np.ndarray, qtype: T, shape: tuple[int, int, int]) -> torch.Tensor:
    """The reference weights ``[E, rows, K]`` as the bank holds them: float64 ``[E, K, rows]``."""
    return torch.from_numpy(_reference(data, qtype).reshape(shape)).double().transpose(1, 2)


def _per_weight(per_group: torch.Tensor) -> torch.Tensor:
    """``[E, K/32, rows]`` -> float64 ``[E, K, rows]``."""
    return per_group.double().repeat_interleave(32, dim=1)


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [E, K, rows/2]`` (low nibble column j, high nibble column j + rows/2) -> ``[E, K, rows]``."""
    return torch.cat([packed & 15, packed >> 4], dim=-1).long()


BANK_SHAPES = [EXPERT_SHAPE, (2, 6, 256), (1, 2, 768)]


@pytest.mark.parametrize("shape", BANK_SHAPES, ids=str)
def test_q8_bank_is_lossless(shape: tuple[int, int, int]) -> None:
    e, rows, k = shape
    data = _source(T.Q8_0, shape, seed=4)
    qs, d = gq.to_q8_bank(_torch_bytes(data), int(T.Q8_0), shape)
    assert qs.dtype == torch.int8 and tuple(qs.shape) == (e, k, rows) and qs.is_contiguous()
    assert d.dtype == torch.float16 and tuple(d.shape) == (e, k // 32, rows) and d.is_contiguous()
    assert torch.equal(qs.double() * _per_weight(d), _reference_kn(data, T.Q8_0, shape))


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=torch.float64)


@pytest.mark.parametrize("shape", BANK_SHAPES, ids=str)
def test_mxfp4_bank_is_lossless(shape: tuple[int, int, int]) -> None:
    e, rows, k = shape
    data = _source(T.MXFP4, shape, seed=5).reshape(-1, 17)
    data[::3, 0] = np.random.default_rng(5).integers(0, 255, data[::3].shape[0])  # all exponents but NaN's
    data = data.reshape(e, rows, -1)
    fp4, e8m0 = gq.to_mxfp4_bank(_torch_bytes(data), int(T.MXFP4), shape)
    assert fp4.dtype == torch.uint8 and tuple(fp4.shape) == (e, k, rows // 2) and fp4.is_contiguous()
    assert e8m0.dtype == torch.uint8 and tuple(e8m0.shape) == (e, k // 32, rows) and e8m0.is_contiguous()
    scale = torch.exp2(_per_weight(e8m0) - 127)  # exact in float64
    w = (E2M1[_unpack_columns(fp4)] * scale).float()  # float32 like the source: it overflows where ggml does
    assert torch.equal(w.double(), _reference_kn(data, T.MXFP4, shape))


# Where a block's 4-bit codes sit, which fp16 field (if any) is the offset term, and the byte that
# sets every code to the one whose weight is exactly the scale (Q4_0: 9, as w = (q - 8) d).
INT4_FIELDS = {T.Q4_0: (slice(2, 18), None, 0x99), T.Q4_1: (slice(4, 20), slice(2, 4), 0x11),
               T.Q4_K: (slice(16, 144), slice(2, 4), 0x11)}


def _exact_scale_and_min(data: np.ndarray, qtype: T, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The source's own (scale, min) per weight, float64 ``[E, K, rows]``, read through the reference:
    with every code 0 it yields ``min``; with the offset field zeroed and every code at the unit
    code it yields ``scale``; both are single float32 products, so exact."""
    codes, offset, unit = INT4_FIELDS[qtype]
    blocks = data.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    zero = blocks.copy()
    zero[:, codes] = 0
    one = blocks.copy()
    one[:, codes] = unit
    if offset is not None:
        one[:, offset] = 0
    mn = _reference_kn(zero.reshape(data.shape), qtype, shape)
    scale = _reference_kn(one.reshape(data.shape), qtype, shape)
    return scale, mn


@pytest.mark.parametrize("shape", BANK_SHAPES, ids=str)
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_int4_bank_keeps_codes_and_rounds_only_scale_and_min(qtype: T, shape: tuple[int, int, int]) -> None:
    e, rows, k = shape
    data = _source(qtype, shape, seed=6)
    q, scale, mn = gq.to_int4_bank(_torch_bytes(data), int(qtype), shape)
    assert q.dtype == torch.uint8 and tuple(q.shape) == (e, k, rows // 2) and q.is_contiguous()
    for t in (scale, mn):
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (e, k // 32, rows) and t.is_contiguous()

    true_scale, true_min = _exact_scale_and_min(data, qtype, shape)
    # Each parameter is the nearest bf16 of the source's exact one.
    assert torch.equal(_per_weight(scale), true_scale.to(torch.bfloat16).double())
    assert torch.equal(_per_weight(mn), true_min.to(torch.bfloat16).double())

    w_bank = _unpack_columns(q).double() * _per_weight(scale) + _per_weight(mn)  # exact in float64
    w_src = _reference_kn(data, qtype, shape)
    bound = 15 * (_per_weight(scale) - true_scale).abs() + (_per_weight(mn) - true_min).abs()
    slack = w_src.abs() * 2.0**-24  # the reference's own float32 rounding of q * scale + min
    err = (w_bank - w_src).abs()
    assert bool((err <= bound + slack).all()), float((err - bound - slack).max())
    assert float(err.max()) > 0  # bf16 does lose something: the bound is not vacuous
    # The docstring's relative form of the same bound, and Q4_0's tighter one (min = -8 * scale).
    assert bool((err <= 2.0**-8 * (15 * true_scale.abs() + true_min.abs()) + slack).all())
    if qtype == T.Q4_0:
        assert bool((err <= 8 * (_per_weight(scale) - true_scale).abs() + slack).all())
