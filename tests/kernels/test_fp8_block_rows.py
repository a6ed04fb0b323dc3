"""moed's FP8 block types in the ggml bank (kernels/fp8_block_format.py, native/cpu/ggml_rows_fp8.c): the rows
built from a checkpoint's codes and scales decode to torch's float8_e4m3fn values times the scales, and every
ISA's dot (float activations: the codes are not integers) and bf16 decode match the torch twin on odd shapes,
several tokens, and every code and E8M0 byte; the int8-activation dots of the GGUF types refuse them."""

from __future__ import annotations

import pytest
import torch

from moed.kernels import fp8_block_format as fb
from moed.kernels.ggml_rows_format import dequantize_rows, row_bytes, rows_product_reference
from moed.kernels.native_cpu import native

TYPES = {"FP8_B128": fb.FP8_B128, "MXFP8": fb.MXFP8}


def _lib():
    lib = native()
    if lib is None:
        pytest.skip("the native CPU kernels are not built")
    return lib


def _codes(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Every finite e4m3 byte (0x7F / 0xFF are NaN), subnormals and both zeros included."""
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
    return torch.where((codes & 0x7F) == 0x7F, codes & 0xF0, codes)


def _fp8_b128(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, the float32 weights they hold) from 128 x 128 block scales, as a checkpoint stores them."""
    gen = torch.Generator().manual_seed(seed)
    codes = _codes(n, k, gen)
    scales = torch.rand(-(-n // 128), k // 128, generator=gen) * 0.02 + 1e-4
    w = codes.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    return fb.fp8_b128_rows(codes.view(torch.float8_e4m3fn), scales), w


def _mxfp8(n: int, k: int, seed: int = 0, exponents: tuple[int, int] = (115, 135)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = _codes(n, k, gen)
    e8m0 = torch.randint(exponents[0], exponents[1], (n, k // 32), dtype=torch.uint8, generator=gen)
    scale = torch.pow(2.0, e8m0.double() - 127).float()
    w = codes.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(32, 1)
    return fb.mxfp8_rows(codes, e8m0), w


BUILD = {"FP8_B128": _fp8_b128, "MXFP8": _mxfp8}


@pytest.mark.parametrize("name", sorted(TYPES))
def test_rows_hold_the_checkpoints_values(name):
    t = TYPES[name]
    for n, k in ((5, 3 * 128), (130, 256)):  # a row count across a 128-row scale block
        rows, w = BUILD[name](n, k)
        assert rows.shape == (n, row_bytes(t, k)) and rows.dtype == torch.uint8
        assert torch.equal(dequantize_rows(rows, t, k), w)


def test_e8m0_reads_every_byte():
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = fb.e8m0_to_f32(e)
    want = torch.pow(2.0, torch.arange(256, dtype=torch.float64) - 127).float()
    assert torch.equal(got[:255], want[:255]) and bool(torch.isnan(got[255]))


@pytest.mark.parametrize("name", sorted(TYPES))
def test_every_isa_matches_the_torch_twin(name):
    lib = _lib()
    t = TYPES[name]
    # FP8_B128: 1, 3 and 7 blocks; MXFP8: 1 to 13 blocks (the one-token kernels take 4 blocks a step, then the rest)
    for k in (128, 3 * 128, 7 * 128) if name == "FP8_B128" else (32, 5 * 32, 7 * 32, 13 * 32):
        rows, _ = BUILD[name](5, k, seed=k)
        for tokens in (1, 3, 17):  # 17: past the kernels' 16-token register block
            x = torch.randn(tokens, k) * torch.linspace(0.1, 3.0, k)
            want, bound = rows_product_reference(rows, t, k, x)
            for isa in lib.available_isas():
                got = torch.stack([lib.ggml_fdot_one(t, isa, rows[r], x) for r in range(5)], dim=1)
                err = (got.double() - want).abs()
                assert bool((err <= 1e-5 * bound + 1e-30).all()), (k, tokens, isa, float((err / bound).max()))


def test_mxfp8_scales_at_both_ends_of_the_range():
    """E8M0 0 and 1 are subnormal floats (2^-127, 2^-126 ... ): every ISA reads them exactly."""
    lib = _lib()
    k = 7 * 32
    rows, w = _mxfp8(4, k, seed=3, exponents=(0, 3))
    assert torch.equal(dequantize_rows(rows, fb.MXFP8, k), w)
    x = torch.randn(2, k)
    want, bound = rows_product_reference(rows, fb.MXFP8, k, x)
    for isa in lib.available_isas():
        got = torch.stack([lib.ggml_fdot_one(fb.MXFP8, isa, rows[r], x) for r in range(4)], dim=1)
        assert bool(((got.double() - want).abs() <= 1e-5 * bound + 1e-300).all()), isa


@pytest.mark.parametrize("name", sorted(TYPES))
def test_bf16_decode_and_the_rows_call(name):
    lib = _lib()
    t = TYPES[name]
    k = 3 * 128
    rows, w = BUILD[name](33, k, seed=5)
    assert torch.equal(lib.ggml_to_bf16(rows, t, k), w.bfloat16())
    assert torch.equal(lib.ggml_to_f32(rows, t, k), w)
    x = torch.randn(2, k)
    (got,) = lib.ggml_rows([(rows, t)], x)
    want, bound = rows_product_reference(rows, t, k, x)
    assert bool(((got.double() - want).abs() <= 1e-5 * bound + 1e-30).all())


def test_a_gguf_file_cannot_name_moeds_own_types(tmp_path):
    from moed.errors import ModelFormatError
    from moed.weights.gguf_file import _tensor_info

    with pytest.raises(ModelFormatError, match="GGML type id 1001, which ggml does not define"):
        _tensor_info(tmp_path / "x.gguf", "blk.0.ffn_gate_exps.weight", fb.FP8_B128, [128, 4], 0, 0)


def test_the_int8_entry_points_refuse_them():
    lib = _lib()
    rows, _ = _mxfp8(1, 64)
    with pytest.raises(ValueError, match="refused"):
        lib.ggml_dot_one(fb.MXFP8, "scalar", rows[0], torch.zeros(1, 64, dtype=torch.int8), torch.ones(1, 2),
                         torch.zeros(1, 2))
