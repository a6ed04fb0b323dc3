"""moed's two FP8 block types for the ggml bank (native/cpu/ggml_rows_fp8.c): FP8 experts kept as stored.

No GGUF type holds float8_e4m3fn weights, so these are moed's own block layouts, read by the same
bank, kernels and loaders as the GGUF types (kernels/ggml_rows_format.py) under ids no GGUF file
uses (a file that names them is refused as corrupt, weights/gguf_file.py):

- ``FP8_B128`` (1001): 128 weights = float32 scale (4 bytes, little-endian) + 128 e4m3 codes: a
  block-scaled FP8 checkpoint's weight (DeepSeek-V3 / V3.2, GLM-5, Qwen3-FP8: 128 x 128 blocks), each
  row holding its block's scale; ``w = e4m3(code) * scale``.
- ``MXFP8`` (1002): 32 weights = E8M0 scale byte + 32 e4m3 codes (OCP MX, compressed-tensors
  ``mxfp8-quantized``); ``w = e4m3(code) * 2^(e - 127)``, e = 255 is NaN.

8.25 bits a weight either way, half of bf16. ``dequantize_blocks`` is the reference for what a block
holds (torch's own float8_e4m3fn decoding); ``fp8_b128_rows`` / ``mxfp8_rows`` build the rows from a
checkpoint's codes and scales, moving bytes only.
"""

from __future__ import annotations

import torch

FP8_B128, MXFP8 = 1001, 1002
NAMES = {FP8_B128: "FP8_B128", MXFP8: "MXFP8"}
BLOCK_SIZES = {FP8_B128: (128, 132), MXFP8: (32, 33)}  # (weights, bytes) per block
HEAD = {FP8_B128: 4, MXFP8: 1}  # scale bytes before the codes


def e8m0_to_f32(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> 2^(e - 127) float32 (e = 0: 2^-127; 255: NaN)."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    bits = torch.where(e == 255, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def dequantize_blocks(b: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Blocks ``uint8 [NB, bytes]`` of FP8_B128 or MXFP8 -> float32 ``[NB, weights]``."""
    head = HEAD[ggml_type]
    values = b[:, head:].contiguous().view(torch.float8_e4m3fn).float()
    if ggml_type == FP8_B128:
        scale = b[:, :4].contiguous().view(torch.float32)
    else:
        scale = e8m0_to_f32(b[:, 0]).unsqueeze(1)
    return values * scale


def fp8_b128_rows(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
                  row_block: int = 128) -> torch.Tensor:
    """``codes`` float8_e4m3fn or uint8 ``[N, K]`` and their block scales float32 ``[ceil(N/row_block), K/128]``
    (a block-scaled checkpoint's ``weight_scale_inv``, blocks of ``row_block`` x 128) -> FP8_B128 rows
    ``uint8 [N, K/128 * 132]`` (into ``out`` when given)."""
    n, k = codes.shape
    if k % 128 or row_block < 1 or tuple(scales.shape) != (-(-n // row_block), k // 128):
        raise ValueError(f"FP8_B128 rows: a [{n}, {k}] weight in {row_block}x128 blocks needs K a multiple of 128 "
                         f"and scales [{-(-n // max(row_block, 1))}, {k // 128}], got {list(scales.shape)}")
    out = torch.empty(n, k // 128, 132, dtype=torch.uint8) if out is None else out.view(n, k // 128, 132)
    per_row = scales.float().repeat_interleave(row_block, dim=0)[:n].contiguous()  # [N, K/128]
    out[:, :, :4] = per_row.view(torch.uint8).view(n, k // 128, 4)
    out[:, :, 4:] = codes.contiguous().view(torch.uint8).view(n, k // 128, 128)
    return out.view(n, -1)


def mxfp8_rows(codes: torch.Tensor, e8m0: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``codes`` float8_e4m3fn or uint8 ``[N, K]`` and their E8M0 scales ``uint8 [N, K/32]`` -> MXFP8 rows
    ``uint8 [N, K/32 * 33]``."""
    n, k = codes.shape
    if k % 32 or tuple(e8m0.shape) != (n, k // 32):
        raise ValueError(f"MXFP8 rows: a [{n}, {k}] weight needs K a multiple of 32 and scales [{n}, {k // 32}], "
                         f"got {list(e8m0.shape)}")
    out = torch.empty(n, k // 32, 33, dtype=torch.uint8) if out is None else out.view(n, k // 32, 33)
    out[:, :, 0] = e8m0.view(torch.uint8)
    out[:, :, 1:] = codes.contiguous().view(torch.uint8).view(n, k // 32, 32)
    return out.view(n, -1)
