"""Asymmetric 4-bit expert weights (group of 32 along K): the torch reference quantizer and dequantizer."""

from __future__ import annotations

import torch

INT4_GROUP_SIZE = 32  # weights per (scale, min) pair, along the input dimension


def _check_kn(w: torch.Tensor, what: str) -> tuple[int, int]:
    if w.dim() < 2:
        raise ValueError(f"{what} must be at least 2-D [..., K, N], got shape {tuple(w.shape)}")
    k, n = w.shape[-2], w.shape[-1]
    if k % INT4_GROUP_SIZE != 0:
        raise ValueError(f"{what}: K={k} is not a multiple of the int4 group size {INT4_GROUP_SIZE}")
    if n % 2 != 0:
        raise ValueError(f"{what}: N={n} must be even (two columns share one byte)")
    return k, n


def _bf16_step(t: torch.Tensor, toward: float) -> torch.Tensor:
    """One bf16 ulp from ``t`` toward ``toward`` (+inf or -inf)."""
    return torch.nextafter(t, torch.full_like(t, toward))


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` float32 ``[..., K, N]`` -> ``(q uint8 [..., K, N/2], scale bf16 [..., K/32, N], min bf16 [..., K/32, N])``.

    ``min`` is rounded to bf16 toward -inf and ``scale`` toward +inf, so the 16 levels
    ``min + q * scale`` always cover ``[min(w), max(w)]`` of the group: the error of every
    weight is at most ``scale / 2`` whatever bf16 did to the two parameters.
    """
    if w.dtype != torch.float32:
        raise ValueError(f"quantize_int4 expects float32 weights, got {w.dtype}")
    k, n = _check_kn(w, "quantize_int4 weights")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_int4: weights contain inf or NaN")
    lead = w.shape[:-2]
    g = w.reshape(*lead, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE, n)  # [..., K/G, G, N]
    wmin = g.amin(dim=-2)  # [..., K/G, N]
    wmax = g.amax(dim=-2)

    mn = wmin.to(torch.bfloat16)
    mn = torch.where(mn.float() > wmin, _bf16_step(mn, float("-inf")), mn)
    span = wmax - mn.float()  # >= 0
    scale = (span / 15.0).to(torch.bfloat16)
    scale = torch.where(scale.float() * 15.0 < span, _bf16_step(scale, float("inf")), scale)

    s = scale.float().unsqueeze(-2)  # [..., K/G, 1, N]
    m = mn.float().unsqueeze(-2)
    # A constant group has scale 0: every q is 0 and the weight is min itself.
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, torch.round((g - m) / safe), torch.zeros_like(g))
    q = q.clamp_(0, 15).to(torch.uint8).reshape(*lead, k, n)  # [..., K, N]

    half = n // 2
    packed = q[..., :half] | (q[..., half:] << 4)  # [..., K, N/2]
    return packed.contiguous(), scale.contiguous(), mn.contiguous()


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """Packed ``uint8 [..., K, N/2]`` -> level indices ``uint8 [..., K, N]`` in 0..15."""
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """``(q uint8 [..., K, N/2], scale bf16 [..., K/32, N], min bf16 [..., K/32, N])`` -> float32 ``[..., K, N]``."""
    if q.dtype != torch.uint8:
        raise ValueError(f"dequantize_int4: q must be uint8, got {q.dtype}")
    if scale.dtype != torch.bfloat16 or mn.dtype != torch.bfloat16:
        raise ValueError(f"dequantize_int4: scale/min must be bfloat16, got {scale.dtype}/{mn.dtype}")
    if q.dim() < 2:
        raise ValueError(f"dequantize_int4: q must be at least 2-D, got shape {tuple(q.shape)}")
    k, n = q.shape[-2], q.shape[-1] * 2
    _check_kn(torch.empty(k, n, device="meta"), "dequantize_int4")
    want = (*q.shape[:-2], k // INT4_GROUP_SIZE, n)
    if tuple(scale.shape) != want or tuple(mn.shape) != want:
        raise ValueError(
            f"dequantize_int4: scale/min must have shape {want} for q {tuple(q.shape)}, "
            f"got {tuple(scale.shape)}/{tuple(mn.shape)}"
        )
    levels = unpack_int4(q).float()  # [..., K, N]
    s = scale.float().repeat_interleave(INT4_GROUP_SIZE, dim=-2)  # [..., K, N]
    m = mn.float().repeat_interleave(INT4_GROUP_SIZE, dim=-2)
    return levels * s + m
