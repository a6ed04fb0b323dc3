"""Symmetric 8-bit expert weights (GGUF Q8_0's block: 32 along K, one fp16 scale): torch reference (de)quantiser.

A matrix ``w [..., K, N]`` (k-major) is stored as ``qs`` int8 ``[..., K, N]`` and ``d`` float16
``[..., K/32, N]`` with ``w[k, n] = qs[k, n] * d[k // 32, n]``. A GGUF Q8_0 block (fp16 ``d``
and 32 int8 along K) is exactly one ``(d, qs[32 rows])`` column segment here, so Q8_0 weights
repack into this layout without loss.
"""

from __future__ import annotations

import torch

Q8_GROUP_SIZE = 32  # weights per fp16 scale, along the input dimension
Q8_MAX = 127  # |qs| the quantiser produces (the format itself also holds -128)
_F16_MAX = 65504.0


def check_q8_k(k: int, what: str) -> None:
    """Refuse a K that is not a whole number of groups."""
    if k % Q8_GROUP_SIZE != 0:
        raise ValueError(f"{what}: K={k} is not a multiple of the q8 group size {Q8_GROUP_SIZE}")


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` float32 ``[..., K, N]`` -> ``(qs int8 [..., K, N], d float16 [..., K/32, N])``.

    ``d = amax / 127`` per group, rounded to fp16 and then stepped up one fp16 ulp where rounding
    made it smaller, so ``|w / d| <= 127`` always holds and every weight's error is at most
    ``d / 2``. An all-zero group gets ``d = 0`` and ``qs = 0``.
    """
    if w.dtype != torch.float32:
        raise ValueError(f"quantize_q8 expects float32 weights, got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"quantize_q8 weights must be at least 2-D [..., K, N], got shape {tuple(w.shape)}")
    k, n = w.shape[-2], w.shape[-1]
    check_q8_k(k, "quantize_q8 weights")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_q8: weights contain inf or NaN")
    lead = w.shape[:-2]
    g = w.reshape(*lead, k // Q8_GROUP_SIZE, Q8_GROUP_SIZE, n)  # [..., K/G, G, N]
    amax = g.abs().amax(dim=-2)  # [..., K/G, N]
    biggest = float(amax.max()) if amax.numel() else 0.0
    if biggest / Q8_MAX > _F16_MAX:
        raise ValueError(
            f"quantize_q8: a weight of magnitude {biggest:.3g} needs a scale above fp16's maximum "
            f"{_F16_MAX:g}; store these experts as bf16 or fp32 instead"
        )
    d = (amax / Q8_MAX).to(torch.float16)
    d = torch.where(d.float() * Q8_MAX < amax, torch.nextafter(d, torch.full_like(d, float("inf"))), d)

    s = d.double().unsqueeze(-2)  # [..., K/G, 1, N]; float64: w / d rounds only once
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, torch.round(g.double() / safe), torch.zeros_like(s))
    qs = q.clamp_(-Q8_MAX, Q8_MAX).to(torch.int8).reshape(*lead, k, n)
    return qs.contiguous(), d.contiguous()


def dequantize_q8(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``(qs int8 [..., K, N], d float16 [..., K/32, N])`` -> float32 ``[..., K, N]`` (exact: 8 x 11 bits fit)."""
    if qs.dtype != torch.int8:
        raise ValueError(f"dequantize_q8: qs must be int8, got {qs.dtype}")
    if d.dtype != torch.float16:
        raise ValueError(f"dequantize_q8: d must be float16, got {d.dtype}")
    if qs.dim() < 2:
        raise ValueError(f"dequantize_q8: qs must be at least 2-D, got shape {tuple(qs.shape)}")
    k, n = qs.shape[-2], qs.shape[-1]
    check_q8_k(k, "dequantize_q8")
    want = (*qs.shape[:-2], k // Q8_GROUP_SIZE, n)
    if tuple(d.shape) != want:
        raise ValueError(f"dequantize_q8: d must have shape {want} for qs {tuple(qs.shape)}, got {tuple(d.shape)}")
    return qs.float() * d.float().repeat_interleave(Q8_GROUP_SIZE, dim=-2)
