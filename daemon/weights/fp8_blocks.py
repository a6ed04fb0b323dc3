"""Block-scaled FP8 weights as DeepSeek-V3 and the Qwen3 FP8 releases ship them.

``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128], ...}``: a linear
weight ``W [out, in]`` is stored as float8_e4m3fn with ``weight_scale_inv [ceil(out/128), ceil(in/128)]``
float32 beside it, and ``W = fp8 * scale_inv`` block by block (the last blocks may be partial).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moed.errors import ModelFormatError, UnsupportedModelError, quoted

SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED = ("fp8 (block-scaled float8_e4m3fn, as DeepSeek-V3 / Qwen3-FP8 ship), "
             "mxfp4 (gpt-oss's MXFP4 experts), compressed-tensors NVFP4 / MXFP8, modelopt NVFP4")
MXFP4_METHOD = "mxfp4"  # handled by hf_checkpoint (experts only): not an FP8 layout


@dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int]


def fp8_config_of(raw_config: dict, where: str) -> Fp8Config | None:
    """None for an unquantized (or MXFP4) checkpoint; the FP8 layout when config.json says fp8; else an error."""
    q = raw_config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method in (MXFP4_METHOD, "compressed-tensors", "modelopt"):
        return None  # read by hf_checkpoint and weights/micro_scaled.py
    if method != "fp8":
        raise UnsupportedModelError(f"{where}: quantization_config.quant_method {quoted(method)} is not supported "
                                    f"(supported: {SUPPORTED}); use an unquantized (bf16) checkpoint")
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise UnsupportedModelError(f"{where}: quantization_config.weight_block_size {quoted(block)} must be two "
                                    "positive integers (per-tensor or per-channel FP8 is not supported)")
    if q.get("fmt", "e4m3") not in ("e4m3", None):
        raise UnsupportedModelError(f"{where}: FP8 format {quoted(q.get('fmt'))} is not supported (only e4m3)")
    return Fp8Config((block[0], block[1]))


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          where: str) -> torch.Tensor:
    """``weight [out, in]`` float8 and ``scale_inv [ceil(out/bo), ceil(in/bi)]`` -> float32 ``[out, in]``."""
    if weight.dim() != 2:
        raise ModelFormatError(f"{where}: an FP8 weight must be 2-D, got shape {list(weight.shape)}")
    out_dim, in_dim = weight.shape
    bo, bi = block
    expected = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != expected:
        raise ModelFormatError(f"{where}: weight_scale_inv has shape {list(scale_inv.shape)}, but a {list(weight.shape)} "
                               f"weight in {bo}x{bi} blocks needs {list(expected)}")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out_dim].repeat_interleave(bi, 1)[:, :in_dim]
    return weight.float() * scale
