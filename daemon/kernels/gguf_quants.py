"""GGML block formats: GGUF tensor bytes -> float32, and lossless repacks of expert tensors into bank rows.

Pure torch and vectorised over blocks (no Python loop per block): ``uint8`` bytes in, float32 or
bank tensors out. The layouts are ggml's (``ggml-common.h``); ``gguf.quants`` is the reference
the tests compare against. Shapes are in numpy/torch order (last dim contiguous), the reverse of
GGUF's ``ne``.

Shape legend: ``NB`` blocks, ``E`` experts, ``R`` rows of a GGUF expert matrix (= bank columns),
``K`` the contiguous (reduction) dim, ``G = 32`` weights per bank scale.
"""

from __future__ import annotations

import math

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moed.kernels import fp8_block_format as fp8b

QK_K = 256  # weights per K-quant super-block
BANK_GROUP = 32  # weights per scale along K in every bank layout (q8, mxfp4, int4)
E8M0_NAN = 255  # the OCP MX NaN exponent (ggml: 2**127)
DEQUANT_SLICE = 1 << 18  # weights decoded per step by `dequantize` (1 MB of float32)

# The type ids and (weights per block, bytes per block) of every type ggml defines, read or not (a
# reader needs the byte size of tensors it skips): the `gguf` package's tables, llama.cpp's own.
_TYPE_NAMES: dict[int, str] = {int(t): t.name for t in GGMLQuantizationType}
_BLOCK_SIZES: dict[int, tuple[int, int]] = {int(t): size for t, size in GGML_QUANT_SIZES.items()}
# moed's own FP8 block types for the ggml bank (kernels/fp8_block_format.py): named and sized like the GGUF
# types, decoded by `dequantize`, but no GGUF file may use them (not `readable`; weights/gguf_file.py)
FP8_B128, MXFP8 = fp8b.FP8_B128, fp8b.MXFP8
MOED_TYPES: tuple[int, ...] = (FP8_B128, MXFP8)
_TYPE_NAMES.update(fp8b.NAMES)
_BLOCK_SIZES.update(fp8b.BLOCK_SIZES)
F32, F16, BF16 = int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16), int(GGMLQuantizationType.BF16)
Q8_0, Q4_0, Q4_1 = int(GGMLQuantizationType.Q8_0), int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1)
Q4_K, Q5_K, Q6_K = int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q5_K), int(GGMLQuantizationType.Q6_K)
MXFP4, NVFP4 = int(GGMLQuantizationType.MXFP4), int(GGMLQuantizationType.NVFP4)
Q5_0, Q5_1 = int(GGMLQuantizationType.Q5_0), int(GGMLQuantizationType.Q5_1)
Q2_K, Q3_K = int(GGMLQuantizationType.Q2_K), int(GGMLQuantizationType.Q3_K)
IQ4_NL, IQ4_XS = int(GGMLQuantizationType.IQ4_NL), int(GGMLQuantizationType.IQ4_XS)
# IQ4_NL / IQ4_XS's 16 non-linear levels (ggml-common.h kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

SUPPORTED_TYPES: tuple[int, ...] = (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
                                    IQ4_NL, IQ4_XS, MXFP4, NVFP4)


class UnsupportedGgufType(ValueError):
    """A GGUF tensor is stored in a GGML type this module does not read."""


_DECODED: tuple[int, ...] | None = None


def decoded_types() -> tuple[int, ...]:
    """GGML types with no torch decoder here that the ``gguf`` package's reference (numpy) decodes:
    IQ1-IQ3, TQ1_0/TQ2_0, Q8_1, ... are read through it (slower, the same values); found once by
    asking it to decode one zero block of each type."""
    global _DECODED
    if _DECODED is None:
        import numpy as np
        from gguf import quants as reference

        found = []
        for t in GGMLQuantizationType:
            if int(t) in SUPPORTED_TYPES or t not in GGML_QUANT_SIZES:
                continue
            try:
                reference.dequantize(np.zeros((1, GGML_QUANT_SIZES[t][1]), dtype=np.uint8), t)
            except (NotImplementedError, ValueError, TypeError, KeyError, AttributeError):
                continue
            found.append(int(t))
        _DECODED = tuple(found)
    return _DECODED


def readable(ggml_type: int) -> bool:
    """Whether ``dequantize`` reads the type (its own decoders or the ``gguf`` package's)."""
    return int(ggml_type) in SUPPORTED_TYPES or int(ggml_type) in decoded_types()


def type_name(ggml_type: int) -> str:
    """``"Q4_K"`` for 12; ``"type 99"`` for an id ggml does not define."""
    return _TYPE_NAMES.get(int(ggml_type), f"type {int(ggml_type)}")


def _supported_names() -> str:
    return ", ".join(type_name(t) for t in SUPPORTED_TYPES)


def _check_supported(ggml_type: int, what: str) -> int:
    ggml_type = int(ggml_type)
    if not readable(ggml_type):
        raise UnsupportedGgufType(
            f"{what}: GGML type {type_name(ggml_type)} (id {ggml_type}) is not supported; moed reads "
            f"{_supported_names()} and, through the gguf package, "
            f"{', '.join(type_name(t) for t in decoded_types())}. Convert the model with llama.cpp's "
            "llama-quantize to one of those (e.g. Q4_K_M or Q8_0)")
    return ggml_type


def type_id(name: str) -> int:
    """``12`` for ``"Q4_K"``; ValueError for a name ggml does not define."""
    for type_id_, type_name_ in _TYPE_NAMES.items():
        if type_name_ == name:
            return type_id_
    raise ValueError(f"{name!r} is not a GGML type name ({', '.join(_TYPE_NAMES.values())})")


def block_size(ggml_type: int) -> tuple[int, int]:
    """``(weights per block, bytes per block)``; known for every ggml type, read or not."""
    size = _BLOCK_SIZES.get(int(ggml_type))
    if size is None:
        raise UnsupportedGgufType(f"GGML type {type_name(ggml_type)} is unknown (not a type ggml defines); "
                                  f"moed reads {_supported_names()}")
    return size


def nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``shape`` (numpy order; the last dim must hold whole blocks)."""
    elems, size = block_size(ggml_type)
    shape = tuple(shape)
    if not shape or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise ValueError(f"{type_name(ggml_type)} tensor: shape {shape} must be one or more non-negative ints")
    if shape[-1] % elems:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {shape}: the last dim {shape[-1]} is not a "
                         f"multiple of the block size {elems}")
    return math.prod(shape[:-1]) * (shape[-1] // elems) * size


def _blocks(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Check ``raw`` against ``shape`` and view it as ``uint8 [NB, bytes per block]``."""
    expected = nbytes(ggml_type, shape)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        got = f"{raw.dtype} tensor of shape {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {tuple(shape)}: raw data must be a 1-D uint8 "
                         f"tensor, got a {got}")
    if raw.numel() != expected:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {tuple(shape)} needs {expected} bytes, "
                         f"got {raw.numel()}")
    size = block_size(ggml_type)[1]
    return raw.contiguous().view(expected // size, size)


def _as_dtype(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the last dim of a uint8 tensor as ``dtype`` (copying only when misaligned)."""
    b = b.contiguous()
    if b.storage_offset() % dtype.itemsize:
        b = b.clone()
    return b.view(dtype)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., 2]`` -> float32 ``[...]``."""
    return _as_dtype(b, torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., n]`` -> ``uint8 [..., 2n]``: the low nibbles of all bytes, then the high ones
    (ggml's order inside a 32-weight block, and inside each 64-weight chunk of a K-quant)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _unpack_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes ``uint8 [NB, 12]`` -> 6-bit ``(sc, m)`` ``uint8 [NB, 8]`` each.

    Bytes 0-3 hold sc[0..3] in their low 6 bits, bytes 4-7 m[0..3]; bytes 8-11 hold the low 4 bits
    of sc[4..7] (low nibble) and m[4..7] (high nibble), whose top 2 bits sit in bits 6-7 of bytes
    0-3 (sc) and 4-7 (m).
    """
    lo_sc, lo_m, packed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 2) & 0x30)], dim=-1)
    m = torch.cat([lo_m & 0x3F, (packed >> 4) | ((lo_m >> 2) & 0x30)], dim=-1)
    return sc, m


def _mxfp4_doubled(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``uint8`` (bit 3 = sign, then 2 exponent bits and 1 mantissa bit) -> twice their
    value as int8, ggml's kvalues_mxfp4 (0, 1, 2, 3, 4, 6, 8, 12 and the negatives; -0 is 0).
    Computed, not looked up: a table lookup would need an int64 index per weight."""
    exp, man = (codes >> 1) & 3, codes & 1
    mag = torch.where(exp == 0, man, (man + 2) << (exp.clamp(min=1) - 1))  # uint8 0..12
    mag = mag.view(torch.int8)
    return torch.where(codes >= 8, -mag, mag)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents ``uint8`` -> float32 ``2**(e - 128)``, ggml_e8m0_to_fp32_half (e = 0, 1 are
    subnormal; e = 255 is 2**127, not NaN)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _ue4m3_half(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's scale bytes ``uint8`` -> float32, gguf's ``NVFP4.ue4m3_to_fp32``: unsigned E4M3 (bit 7
    ignored, bias 7, subnormal at exponent 0) times 1/2; the byte 0x7F (NaN) is 0."""
    e, m = ((x >> 3) & 0x0F).to(torch.int32), (x & 7).to(torch.float32)
    value = torch.where(e == 0, m * 2.0 ** -10, (m + 8) * torch.exp2((e - 11).to(torch.float32)))
    return torch.where(x == 0x7F, torch.zeros_like(value), value)


def _q4_k_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 128 low-nibble bytes ``[NB, 128]`` -> codes ``uint8 [NB, 8, 32]`` (sub-block, weight):
    32-byte chunk c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    return _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)


def _q4_k_params(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K block ``[NB, >=16]`` -> float32 ``(d * sc, dmin * m)`` ``[NB, 8]``; both products exact."""
    sc, m = _unpack_k_scales(b[:, 4:16])
    return _f16(b[:, 0:2]).unsqueeze(-1) * sc, _f16(b[:, 2:4]).unsqueeze(-1) * m


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: ``qh`` ``uint8 [NB, 4]`` (bit j of the little-endian u32 = bit 4 of weight j) and
    ``qs [NB, 16]`` (low nibbles: weights 0-15, high: 16-31) -> codes ``uint8 [NB, 32]`` 0..31."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    high = ((qh.unsqueeze(-1) >> shifts) & 1).reshape(-1, 32)  # byte i bit k -> weight 8i + k
    return _nibbles(qs) | (high << 4)


def _iq4(codes: torch.Tensor) -> torch.Tensor:
    """IQ4 codes ``uint8`` -> their int8 levels (IQ4_LEVELS), by arithmetic on a 16-entry table."""
    table = torch.tensor(IQ4_LEVELS, dtype=torch.int8, device=codes.device)
    return table[codes.long()]


def _dequant_blocks(b: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``uint8 [NB, bytes]`` -> float32 ``[NB, weights per block]`` (quantised types only)."""
    if ggml_type == Q5_0:  # d fp16, qh u32, qs[16]: w = (q - 16) * d
        q = _q5_codes(b[:, 2:6], b[:, 6:]).view(torch.int8) - 16
        return torch.mul(q, _f16(b[:, 0:2]).unsqueeze(-1))
    if ggml_type == Q5_1:  # d, m fp16, qh u32, qs[16]: w = q * d + m
        w = torch.mul(_q5_codes(b[:, 4:8], b[:, 8:]), _f16(b[:, 0:2]).unsqueeze(-1))
        return w.add_(_f16(b[:, 2:4]).unsqueeze(-1))
    if ggml_type == Q2_K:  # scales[16] (low nibble sc, high m), qs[64], d, dmin fp16: w = d*sc*q - dmin*m per 16
        sc, qs = b[:, 0:16], b[:, 16:80]
        dl = (_f16(b[:, 80:82]).unsqueeze(-1) * (sc & 0x0F)).unsqueeze(-1)  # [NB, 16, 1]
        ml = (_f16(b[:, 82:84]).unsqueeze(-1) * (sc >> 4)).unsqueeze(-1)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
        q = ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)  # 128-weight half, shift, 32 weights
        return (dl * q).sub_(ml).view(-1, QK_K)
    if ggml_type == Q3_K:  # hmask[32], qs[64], scales[12] (16 x 6 bits, -32), d: w = d*sc*(q - 4*(1 - hbit)) per 16
        hmask, qs, packed = b[:, 0:32], b[:, 32:96], b[:, 96:108]
        low = (packed[:, 0:8].unsqueeze(1) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device).view(1, 2, 1))
        high = (packed[:, 8:12].unsqueeze(1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                             device=b.device).view(1, 4, 1))
        sc = (low.reshape(-1, 16) & 0x0F) | ((high.reshape(-1, 16) & 3) << 4)
        dl = (_f16(b[:, 108:110]).unsqueeze(-1) * (sc.view(torch.int8) - 32)).unsqueeze(-1)  # [NB, 16, 1]
        ql = (qs.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8,
                                                       device=b.device).view(1, 1, 4, 1)) & 3
        qh = (hmask.reshape(-1, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 1, 8, 1)) & 1
        q = ql.reshape(-1, 16, 16).view(torch.int8) - ((qh.reshape(-1, 16, 16) ^ 1) << 2).view(torch.int8)
        return (dl * q).view(-1, QK_K)
    if ggml_type == IQ4_NL:  # d fp16, qs[16]: w = d * level(q)
        return torch.mul(_iq4(_nibbles(b[:, 2:])), _f16(b[:, 0:2]).unsqueeze(-1))
    if ggml_type == IQ4_XS:  # d fp16, scales_h u16, scales_l[4], qs[128]: w = d*(ls - 32)*level(q) per 32
        sh = _as_dtype(b[:, 2:4], torch.int16).to(torch.int32)  # [NB, 1]
        lo = (b[:, 4:8].unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device)).reshape(-1, 8) & 0x0F
        hi = (sh >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3  # [NB, 8]
        ls = (lo.to(torch.int32) | (hi << 4)) - 32
        dl = (_f16(b[:, 0:2]).unsqueeze(-1) * ls).unsqueeze(-1)  # [NB, 8, 1]
        levels = _iq4(_nibbles(b[:, 8:].reshape(-1, 8, 16)))  # [NB, 8, 32]
        return (dl * levels).view(-1, QK_K)
    if ggml_type == Q8_0:  # d fp16, qs int8[32]: w = qs * d
        return torch.mul(_as_dtype(b[:, 2:], torch.int8), _f16(b[:, 0:2]).unsqueeze(-1))
    if ggml_type == Q4_0:  # d fp16, qs[16] (two nibbles): w = (q - 8) * d
        q = _nibbles(b[:, 2:]).view(torch.int8) - 8
        return torch.mul(q, _f16(b[:, 0:2]).unsqueeze(-1))
    if ggml_type == Q4_1:  # d fp16, m fp16, qs[16]: w = q * d + m
        w = torch.mul(_nibbles(b[:, 4:]), _f16(b[:, 0:2]).unsqueeze(-1))
        return w.add_(_f16(b[:, 2:4]).unsqueeze(-1))
    if ggml_type == MXFP4:  # e e8m0, qs[16] (two E2M1 codes): w = kvalue(code) * 2**(e - 128)
        # ggml doubles the E2M1 table and halves the scale: the product is the OCP e2m1 * 2**(e - 127).
        return torch.mul(_mxfp4_doubled(_nibbles(b[:, 1:])), _e8m0_half(b[:, 0:1]))
    if ggml_type == NVFP4:  # d ue4m3[4], qs[32] (8 bytes per 16: low nibbles 0-7, high 8-15): w = d_h/2 * kvalue
        codes = _mxfp4_doubled(_nibbles(b[:, 4:].reshape(-1, 4, 8)))  # [NB, 4, 16]
        return torch.mul(codes, _ue4m3_half(b[:, 0:4]).unsqueeze(-1)).view(-1, 64)
    if ggml_type == Q4_K:  # d, dmin fp16, scales[12], qs[128]: w = d * sc_j * q - dmin * m_j
        ds, dm = _q4_k_params(b)
        w = torch.mul(_q4_k_codes(b[:, 16:]), ds.unsqueeze(-1))  # [NB, 8, 32]
        return w.sub_(dm.unsqueeze(-1)).view(-1, QK_K)
    if ggml_type == Q5_K:  # as Q4_K plus qh[32]: bit j of qh[l] is bit 4 of weight l of sub-block j
        ds, dm = _q4_k_params(b)
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
        high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # [NB, 8, 32]
        q = _q4_k_codes(b[:, 48:]) | (high << 4)
        w = torch.mul(q, ds.unsqueeze(-1))
        return w.sub_(dm.unsqueeze(-1)).view(-1, QK_K)
    if ggml_type == Q6_K:  # ql[128], qh[64], scales int8[16], d fp16: w = d * sc_i * (q - 32), 16 per sc
        # Each 128-weight half h: weight j has its low 4 bits in nibble j // 64 of ql[64h + j % 64]
        # and its top 2 bits at bit 2 * (j // 32) of qh[32h + j % 32].
        low = _nibbles(b[:, 0:128].reshape(-1, 2, 64))  # [NB, 2, 128]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
        high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 2, 128)
        q = (low | (high << 4)).view(torch.int8) - 32  # [NB, 2, 128], -32..31
        ds = _as_dtype(b[:, 192:208], torch.int8) * _f16(b[:, 208:210]).unsqueeze(-1)  # [NB, 16]
        return torch.mul(q.view(-1, 16, 16), ds.unsqueeze(-1)).view(-1, QK_K)
    raise AssertionError(f"no block decoder for {type_name(ggml_type)}")


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...],
               slice_weights: int | None = DEQUANT_SLICE) -> torch.Tensor:
    """1-D uint8 ``raw`` of exactly ``nbytes(ggml_type, shape)`` bytes -> float32 tensor of ``shape``.

    ``slice_weights`` weights are decoded per step (the temporaries of a step stay in a CPU's cache);
    None decodes the whole tensor in one step (a GPU: a few kernel launches instead of a few per slice).

    F32 comes back as a view of ``raw``'s memory (no copy); every other type is a new tensor.
    Bit-equal to ``gguf.quants.dequantize`` for every type here (the K-quants included: each of
    their products is exact in float32 and the one subtraction rounds as numpy's does).
    """
    if int(ggml_type) in MOED_TYPES:  # moed's FP8 rows (the ggml bank of an FP8 checkpoint)
        b = _blocks(raw, int(ggml_type), shape)
        return fp8b.dequantize_blocks(b, int(ggml_type)).reshape(shape)
    ggml_type = _check_supported(ggml_type, f"GGUF tensor of shape {tuple(shape)}")
    b = _blocks(raw, ggml_type, shape)
    if ggml_type == F32:
        return _as_dtype(b, torch.float32).view(shape)
    if ggml_type == F16:
        return _as_dtype(b, torch.float16).view(shape).float()
    if ggml_type == BF16:
        return _as_dtype(b, torch.bfloat16).view(shape).float()
    # Decoded a slice of blocks at a time into one output: the uint8/int8 temporaries of a slice
    # stay in cache, and the peak is the float32 output plus a few slices, whatever the tensor size.
    elems = block_size(ggml_type)[0]
    out = torch.empty((b.shape[0], elems), dtype=torch.float32, device=b.device)
    step = max(1, b.shape[0] if slice_weights is None else slice_weights // elems)
    decode = _dequant_blocks if ggml_type in SUPPORTED_TYPES else _reference_blocks
    for start in range(0, b.shape[0], step):
        out[start:start + step] = decode(b[start:start + step], ggml_type)
    return out.view(shape)


def _reference_blocks(b: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Blocks ``uint8 [NB, bytes]`` of a type only the ``gguf`` package decodes -> float32 ``[NB, elems]``."""
    from gguf import quants as reference

    return torch.from_numpy(reference.dequantize(b.cpu().numpy(), GGMLQuantizationType(ggml_type)).astype("float32"))


def _expert_blocks(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], accepted: tuple[int, ...],
                   what: str, need_even_rows: bool) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Check an expert tensor ``[E, R, K]`` of an ``accepted`` type; its blocks ``uint8 [E, R, K/block, bytes]``."""
    ggml_type = _check_supported(ggml_type, f"{what}: expert tensor of shape {tuple(shape)}")
    if ggml_type not in accepted:
        raise UnsupportedGgufType(f"{what} takes {', '.join(type_name(t) for t in accepted)} expert tensors, "
                         f"got {type_name(ggml_type)}")
    if len(shape) != 3:
        raise ValueError(f"{what}: an expert tensor must be 3-D [experts, rows, K], got shape {tuple(shape)}")
    e, r, k = shape
    if need_even_rows and r % 2:
        raise ValueError(f"{what}: {type_name(ggml_type)} expert tensor of shape {tuple(shape)} has an odd "
                         f"row count {r}; the 4-bit bank packs columns j and j + {r}/2 into one byte")
    b = _blocks(raw, ggml_type, shape)
    return b.view(e, r, k // block_size(ggml_type)[0], b.shape[-1]), (e, r, k)


def _pack_columns(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``uint8 [E, R, K]`` -> bank bytes ``uint8 [E, K, R/2]``: byte ``[k, j]`` holds
    column ``j`` in its low nibble and column ``j + R/2`` in its high one."""
    half = codes.shape[1] // 2
    packed = codes[:, :half] | (codes[:, half:] << 4)  # [E, R/2, K]; packed before the transpose: half the bytes
    return packed.transpose(1, 2).contiguous()


def _per_column(x: torch.Tensor) -> torch.Tensor:
    """``[E, R, K/G]`` -> ``[E, K/G, R]`` contiguous (a bank's per-group parameters)."""
    return x.transpose(1, 2).contiguous()


def to_q8_bank(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 expert tensor ``[E, R, K]`` -> q8 bank rows ``(qs int8 [E, K, R], d float16 [E, K/32, R])``.

    ``w[k, n] = qs[k, n] * d[k // 32, n]`` reproduces the source exactly (Q8_0 is 32 int8 along K
    with one fp16 scale, which is what the bank holds).
    """
    b, (e, r, k) = _expert_blocks(raw, ggml_type, shape, (Q8_0,), "to_q8_bank", need_even_rows=False)
    d = _as_dtype(b[..., 0:2], torch.float16).squeeze(-1)  # [E, R, K/32]
    qs = _as_dtype(b[..., 2:], torch.int8).reshape(e, r, k)
    return qs.transpose(1, 2).contiguous(), _per_column(d)


def to_mxfp4_bank(raw: torch.Tensor, ggml_type: int,
                  shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 expert tensor ``[E, R, K]`` -> mxfp4 bank rows ``(fp4 uint8 [E, K, R/2], e8m0 uint8 [E, K/32, R])``.

    Lossless: ``w[k, n] = e2m1(code[k, n]) * 2**(e8m0[k // 32, n] - 127)`` with the standard E2M1
    table (0, 0.5, 1, 1.5, 2, 3, 4, 6, then the negatives), which is ggml's doubled table times its
    halved scale. The one exponent they read differently, 255 (2**127 in ggml, NaN in OCP MX and
    the bank), is refused; quantisers never write it.
    """
    b, (e, r, k) = _expert_blocks(raw, ggml_type, shape, (MXFP4,), "to_mxfp4_bank", need_even_rows=True)
    if bool((b[..., 0] == E8M0_NAN).any()):
        raise ValueError(f"to_mxfp4_bank: MXFP4 expert tensor of shape {tuple(shape)} has the e8m0 exponent "
                         f"{E8M0_NAN}, which ggml reads as 2**127 but the mxfp4 bank holds as NaN; the file is "
                         "probably corrupt (dequantize it to load it in another bank dtype)")
    codes = _nibbles(b[..., 1:]).view(e, r, k)  # [E, R, K]
    return _pack_columns(codes), _per_column(b[..., 0])


def to_int4_bank(raw: torch.Tensor, ggml_type: int,
                 shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K expert tensor ``[E, R, K]`` -> int4 bank rows keeping the 4-bit codes:
    ``(q uint8 [E, K, R/2], scale bfloat16 [E, K/32, R], min bfloat16 [E, K/32, R])`` with
    ``w[k, n] = q[k, n] * scale[k // 32, n] + min[k // 32, n]`` (layout of cache/host_bank.py).

    Q4_0 ``(q - 8) * d``: scale = d, min = -8 d. Q4_1 ``q * d + m``: scale = d, min = m. Q4_K
    ``d * sc_j * q - dmin * m_j`` per 32-weight sub-block j: scale = d * sc_j, min = -dmin * m_j.

    The codes are kept, so the only loss is rounding scale and min (exact in float32) to the
    nearest bf16 (8 significant bits, relative error <= 2**-8); per weight
    ``|w_bank - w_src| <= 15 * |scale - bf16(scale)| + |min - bf16(min)| <= 2**-8 * (15 |scale| + |min|)``.
    For Q4_0 it is tighter: -8 d rounds exactly as d does, so the error is ``|q - 8| * |d - bf16(d)|
    <= 8 * 2**-8 * |d|``, 3% of a quantisation step.
    """
    b, (e, r, k) = _expert_blocks(raw, ggml_type, shape, (Q4_0, Q4_1, Q4_K), "to_int4_bank", need_even_rows=True)
    flat = b.view(-1, b.shape[-1])  # [E * R * NB, bytes]
    if ggml_type == Q4_K:
        scale, neg_min = _q4_k_params(flat)  # [E*R*NB, 8]
        mn = -neg_min
        codes = _q4_k_codes(flat[:, 16:])
    else:
        scale = _f16(flat[:, 0:2]).unsqueeze(-1)  # [E*R*NB, 1]
        if ggml_type == Q4_0:
            mn, codes = scale * -8.0, _nibbles(flat[:, 2:])
        else:
            mn, codes = _f16(flat[:, 2:4]).unsqueeze(-1), _nibbles(flat[:, 4:])
    groups = k // BANK_GROUP
    scale = scale.to(torch.bfloat16).view(e, r, groups)
    mn = mn.to(torch.bfloat16).view(e, r, groups)
    return _pack_columns(codes.view(e, r, k)), _per_column(scale), _per_column(mn)
