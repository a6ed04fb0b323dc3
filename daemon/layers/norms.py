"""RMSNorm, computed in float32 as the reference implementations do.

At decode (a few rows on the CPU) the native library does it, with the residual add before it
(``add_rms_norm``), in one call instead of six torch ops; the torch code here is its reference.
"""

from __future__ import annotations

import torch

from moed.kernels.native_cpu import MAX_TOKENS, native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D]."""
    if _native(x, weight):
        return native().add_rms_norm(x, None, weight, eps)[1]
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta, weight, eps))``: the residual add and the next norm."""
    if _native(x, weight) and delta.dtype == torch.float32 and delta.is_contiguous() and delta.shape == x.shape:
        return native().add_rms_norm(x, delta, weight, eps)
    x = x + delta
    return x, rms_norm(x, weight, eps)


def _native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() and x.dim() >= 1
            and 0 < x.numel() <= MAX_TOKENS * x.shape[-1] and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.device.type == "cpu" and weight.is_contiguous() and tuple(weight.shape) == (x.shape[-1],)
            and native() is not None)
