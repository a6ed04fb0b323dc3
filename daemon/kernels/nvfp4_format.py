"""NVFP4 and MXFP8 weights as Hugging Face checkpoints publish them (NVIDIA ModelOpt, llm-compressor).

NVFP4 (a Linear ``w [N, K]``, K a multiple of 16):

- packed codes uint8 ``[N, K/2]``: byte ``j`` of a row holds element ``2j`` in its low nibble and
  ``2j + 1`` in its high one; each nibble an E2M1 code (bit 3 sign, magnitudes 0, .5, 1, 1.5, 2,
  3, 4, 6: mxfp4_format.E2M1_VALUES);
- a float8_e4m3fn scale per 16 consecutive elements, ``[N, K/16]``;
- one float32 factor per tensor: compressed-tensors stores ``weight_global_scale`` g and computes
  ``w = e2m1 * (scale / g)``; ModelOpt stores ``weight_scale_2`` s2 and ``w = e2m1 * scale * s2``.

llama.cpp's NVFP4 block (GGML type 40, gguf_quants.py) holds the same codes and scales: 64 weights
as 4 scale bytes (unsigned E4M3, one per 16) then 32 code bytes, 8 per 16 weights (byte ``8s + j``:
weight ``16s + j`` low, ``16s + 8 + j`` high). ``to_ggml_nvfp4`` moves one into the other without
loss (a scale with its sign bit set gives its sign to its 16 codes instead); the per-tensor factor
stays beside the rows (the ggml bank's per-expert scale, cache/host_bank.py).

MXFP8 (OCP MX, llm-compressor's ``mxfp8-quantized``): float8_e4m3fn ``[N, K]`` and one E8M0
exponent byte per 32, ``w = fp8 * 2**(e - 127)``; every such product is a bfloat16 exactly (4
significant bits), so a bf16 copy loses nothing.
"""

from __future__ import annotations

import torch

from moed.kernels.mxfp4_format import e2m1_values, e8m0_scale

NVFP4_GROUP = 16  # weights per E4M3 scale
GGML_NVFP4_BLOCK = 64  # weights per llama.cpp NVFP4 block (4 scales, 32 code bytes)
MXFP8_GROUP = 32  # weights per E8M0 exponent
E4M3_NAN = 0x7F  # float8_e4m3fn's NaN, with or without the sign bit


def nvfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> E2M1 codes uint8 ``[N, K]`` (element ``2j`` from the low nibble of byte ``j``)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, *, times: torch.Tensor | None = None,
                     divided_by: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``packed uint8 [N, K/2]`` and ``scale float8_e4m3fn [N, K/16]`` -> float32 ``[N, K]``,
    ``e2m1 * group`` where each group's factor is formed in float32 first: ``scale * times`` (ModelOpt's
    ``weight_scale_2``) or ``scale / divided_by`` (compressed-tensors' ``weight_global_scale``)."""
    n, half = packed.shape
    if tuple(scale.shape) != (n, 2 * half // NVFP4_GROUP) or scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"NVFP4 scales must be float8_e4m3fn [{n}, {2 * half // NVFP4_GROUP}], got "
                         f"{scale.dtype} {list(scale.shape)}")
    group = scale.to(torch.float32)
    if times is not None:
        group = group * times.to(torch.float32).reshape(())
    if divided_by is not None:
        group = group / divided_by.to(torch.float32).reshape(())
    values = e2m1_values(nvfp4_codes(packed)).view(n, -1, NVFP4_GROUP)
    return (values * group.unsqueeze(-1)).reshape(n, -1)


def to_ggml_nvfp4(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A checkpoint's NVFP4 codes and scales -> llama.cpp NVFP4 rows uint8 ``[N, K/64 * 36]`` (into ``out``
    when given), the same values times the same per-tensor factor. K must be a multiple of 64; a NaN
    scale is refused."""
    n, half = packed.shape
    k = 2 * half
    if k % GGML_NVFP4_BLOCK:
        raise ValueError(f"NVFP4 rows of {k} weights do not fill whole {GGML_NVFP4_BLOCK}-weight blocks")
    nb = k // GGML_NVFP4_BLOCK
    sbytes = scale.contiguous().view(torch.uint8)
    if bool(((sbytes & 0x7F) == E4M3_NAN).any()):
        raise ValueError("an NVFP4 scale is NaN (E4M3 0x7F)")
    out = torch.empty(n, nb * 36, dtype=torch.uint8) if out is None else out
    blocks = out.view(n, nb, 36)
    # per 16 weights, 8 bytes: the checkpoint's byte i holds weights 2i (low) and 2i + 1 (high); ggml's
    # byte j holds j (low) and 8 + j (high). With lo = bytes 0-3 (weights 0-7), hi = bytes 4-7:
    # ggml byte 2i = lo[i] low | hi[i] low << 4, byte 2i + 1 = lo[i] high >> 4 | hi[i] high
    runs = packed.reshape(n, k // NVFP4_GROUP, 2, 4)
    negative = sbytes >> 7
    if bool(negative.any()):
        runs = runs ^ (negative * 0x88).view(n, -1, 1, 1)  # a negative scale's sign moves onto its codes
    lo, hi = runs[:, :, 0].reshape(n, nb, 4, 4), runs[:, :, 1].reshape(n, nb, 4, 4)  # [row, block, run, i]
    qs = blocks[:, :, 4:].unflatten(2, (4, 4, 2))  # [row, block, run, i, even/odd byte]
    torch.bitwise_or(lo & 0x0F, hi << 4, out=qs[..., 0])
    torch.bitwise_or(lo >> 4, hi & 0xF0, out=qs[..., 1])
    torch.bitwise_and(sbytes.view(n, nb, 4), 0x7F, out=blocks[:, :, :4])
    return out


def dequantize_mxfp8(fp8: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """The reference: ``(float8_e4m3fn [N, K], uint8 [N, K/32])`` -> float32 ``[N, K]``, ``fp8 * 2**(e - 127)``."""
    n, k = fp8.shape
    if fp8.dtype != torch.float8_e4m3fn or tuple(e8m0.shape) != (n, k // MXFP8_GROUP) or k % MXFP8_GROUP:
        raise ValueError(f"MXFP8 wants float8_e4m3fn [N, K] (K a multiple of {MXFP8_GROUP}) and uint8 "
                         f"[N, K/{MXFP8_GROUP}] exponents, got {fp8.dtype} {list(fp8.shape)} and {list(e8m0.shape)}")
    values = fp8.to(torch.float32).view(n, -1, MXFP8_GROUP)
    return (values * e8m0_scale(e8m0).unsqueeze(-1)).reshape(n, k)
