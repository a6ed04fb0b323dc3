"""MXFP4 expert weights (OCP microscaling: E2M1 codes, one e8m0 exponent per 32 along K), as gpt-oss ships them.

Bank layout of a matrix ``w [..., K, N]`` (k-major): ``fp4`` uint8 ``[..., K, N/2]`` (byte
``[k, j]``: low nibble = column ``j``, high nibble = column ``j + N/2``, the int4 column
packing) and ``e8m0`` uint8 ``[..., K/32, N]``; ``w[k, n] = e2m1(code[k, n]) * 2**(e8m0[k // 32, n] - 127)``.
An E2M1 code has bit 3 = sign and magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7.

gpt-oss's Hugging Face layout (``*_blocks`` uint8 ``[..., rows, K/32, 16]``, byte ``b`` of a
block: low nibble = element ``2b``, high nibble = element ``2b + 1``; ``*_scales`` uint8
``[..., rows, K/32]``) holds the same codes and exponents in another order, so
``from_gpt_oss_blocks`` is pure bit repacking, without loss. Here the torch reference
(de)quantiser, both repackings, and the helpers the kernels and the device path share.
"""

from __future__ import annotations

import torch

from moed.kernels.int4_format import unpack_int4

MXFP4_GROUP_SIZE = 32  # weights per e8m0 exponent, along the input dimension
E8M0_BIAS = 127
E8M0_NAN = 255  # the OCP MX encoding of NaN: refused
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_EMAX = 2  # exponent of the largest E2M1 magnitude (6 = 1.5 * 2**2)
# Round-to-nearest boundaries between consecutive magnitudes; at the ties listed in _TIES_UP the
# upper neighbour has the even mantissa (ties to even), at the others the lower one does.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


def _check_k(k: int, what: str) -> None:
    if k % MXFP4_GROUP_SIZE != 0:
        raise ValueError(f"{what}: K={k} is not a multiple of the mxfp4 group size {MXFP4_GROUP_SIZE}")


def e8m0_scale(e8m0: torch.Tensor) -> torch.Tensor:
    """uint8 exponents -> float32 ``2**(e - 127)``, exactly (built from bits; ``e = 0`` is the subnormal 2**-127)."""
    e = e8m0.to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 1 << 22))
    return bits.view(torch.float32)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> their E2M1 values as float32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def _nearest_magnitude(a: torch.Tensor) -> torch.Tensor:
    """``a >= 0`` (float64) -> code 0..7 of the nearest E2M1 magnitude, ties to even, above 6 -> 6."""
    mids = torch.tensor(_MIDPOINTS, dtype=a.dtype, device=a.device)
    code = torch.bucketize(a.contiguous(), mids)  # a == a midpoint -> the lower neighbour
    ties_up = torch.isin(a, torch.tensor(_TIES_UP, dtype=a.dtype, device=a.device))
    return (code + ties_up.to(code.dtype)).to(torch.uint8)


def _quantize_codes(w: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``w [..., K, N]`` -> ``(codes uint8 [..., K, N], e8m0 uint8 [..., K/32, N])``.

    OCP MX's conversion: the group's shared exponent is ``floor(log2(amax)) - 2`` (so the largest
    weight lands in [4, 8) and is clamped to 6 above 6), clamped to e8m0's range; each weight
    becomes the nearest E2M1 value of ``w / 2**exponent``.
    """
    if w.dtype != torch.float32:
        raise ValueError(f"{what} expects float32 weights, got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"{what} weights must be at least 2-D [..., K, N], got shape {tuple(w.shape)}")
    k, n = w.shape[-2], w.shape[-1]
    _check_k(k, what)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: weights contain inf or NaN")
    lead = w.shape[:-2]
    g = w.reshape(*lead, k // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE, n)  # [..., K/G, G, N]
    amax = g.abs().amax(dim=-2)  # [..., K/G, N]
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    shared = (exp.to(torch.int32) - 1 - E2M1_EMAX).clamp_(-E8M0_BIAS, E8M0_BIAS)
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS))  # all-zero group
    e8m0 = (shared + E8M0_BIAS).to(torch.uint8)  # 0..254
    scale = e8m0_scale(e8m0).double().unsqueeze(-2)  # [..., K/G, 1, N]
    a = g.double().abs() / scale  # exact: a power-of-two divisor, float64 range
    code = _nearest_magnitude(a)
    code = code | ((g < 0) & (code > 0)).to(torch.uint8) << 3  # no -0: a weight that rounds to 0 is +0
    return code.reshape(*lead, k, n), e8m0.contiguous()


def _pack_columns(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K, N]`` -> ``[..., K, N/2]``: column ``j`` low nibble, column ``j + N/2`` high."""
    n = codes.shape[-1]
    if n % 2:
        raise ValueError(f"mxfp4 bank matrices need an even number of columns (two share one byte), got {n}")
    return (codes[..., : n // 2] | (codes[..., n // 2 :] << 4)).contiguous()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` float32 ``[..., K, N]`` -> ``(fp4 uint8 [..., K, N/2], e8m0 uint8 [..., K/32, N])`` in bank layout."""
    codes, e8m0 = _quantize_codes(w, "quantize_mxfp4")
    return _pack_columns(codes), e8m0


def dequantize_mxfp4(fp4: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """``(fp4 uint8 [..., K, N/2], e8m0 uint8 [..., K/32, N])`` -> float32 ``[..., K, N]`` (exact)."""
    if fp4.dtype != torch.uint8 or e8m0.dtype != torch.uint8:
        raise ValueError(f"dequantize_mxfp4: fp4 and e8m0 must be uint8, got {fp4.dtype}/{e8m0.dtype}")
    if fp4.dim() < 2:
        raise ValueError(f"dequantize_mxfp4: fp4 must be at least 2-D, got shape {tuple(fp4.shape)}")
    k, n = fp4.shape[-2], fp4.shape[-1] * 2
    _check_k(k, "dequantize_mxfp4")
    want = (*fp4.shape[:-2], k // MXFP4_GROUP_SIZE, n)
    if tuple(e8m0.shape) != want:
        raise ValueError(f"dequantize_mxfp4: e8m0 must have shape {want} for fp4 {tuple(fp4.shape)}, "
                         f"got {tuple(e8m0.shape)}")
    scale = e8m0_scale(e8m0).repeat_interleave(MXFP4_GROUP_SIZE, dim=-2)  # [..., K, N]
    return e2m1_values(unpack_int4(fp4)) * scale


def from_gpt_oss_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss ``blocks`` uint8 ``[..., rows, K/32, 16]`` and ``scales`` uint8 ``[..., rows, K/32]`` ->
    bank ``(fp4 uint8 [..., K, rows/2], e8m0 uint8 [..., K/32, rows])``: k-major, rows become columns.

    Only bits move. gpt-oss's ``gate_up_proj`` interleaves gate and up rows (gate = even rows);
    the bank wants gate columns first, so permute the rows of both inputs before calling.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"gpt-oss MXFP4 blocks and scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != MXFP4_GROUP_SIZE // 2:
        raise ValueError(f"gpt-oss MXFP4 blocks must be [..., rows, K/32, 16], got shape {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"gpt-oss MXFP4 scales must have shape {tuple(blocks.shape[:-1])} (the blocks' "
                         f"{tuple(blocks.shape)} without the last dimension), got {tuple(scales.shape)}")
    if bool((scales == E8M0_NAN).any()):
        raise ValueError(f"gpt-oss MXFP4 scales contain {E8M0_NAN}, the MX encoding of NaN; the checkpoint is damaged")
    *lead, rows, groups, _ = blocks.shape
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*lead, rows, groups * MXFP4_GROUP_SIZE)
    return _pack_columns(codes.transpose(-1, -2)), scales.transpose(-1, -2).contiguous()


def to_gpt_oss_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``w [..., rows, K]`` (gpt-oss orientation) -> ``(blocks uint8 [..., rows, K/32, 16],
    scales uint8 [..., rows, K/32])`` in gpt-oss's layout, quantised as ``quantize_mxfp4`` does."""
    if w.dim() < 2:
        raise ValueError(f"to_gpt_oss_blocks weights must be at least 2-D [..., rows, K], got shape {tuple(w.shape)}")
    codes, e8m0 = _quantize_codes(w.transpose(-1, -2), "to_gpt_oss_blocks")  # [..., K, rows], [..., K/32, rows]
    *lead, rows, k = w.shape
    pairs = codes.transpose(-1, -2).reshape(*lead, rows, k // MXFP4_GROUP_SIZE, MXFP4_GROUP_SIZE // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), e8m0.transpose(-1, -2).contiguous()
