"""Rotary position embeddings: inverse frequencies for default/linear/llama3/yarn/factors, and their application.

Shapes: P positions, R rotated dims per head (``RopeConfig.dim``), H heads.
"""

from __future__ import annotations

import math

import torch

from moed.layers.layer_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [R/2], attention_factor) following transformers' rope initialisers."""
    dim, base = rope.dim, rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / float(rope.param("factor", 1.0)), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    if rope.rope_type == "proportional":  # Gemma-4: pairs past partial * dim / 2 do not rotate (frequency 0)
        rotated = int(float(rope.param("partial_rotary_factor", 1.0)) * dim // 2)
        inv_freq[rotated:] = 0.0
        return inv_freq / float(rope.param("factor", 1.0) or 1.0), 1.0
    if rope.rope_type == "factors":  # llama.cpp's rope_freqs: each frequency divided by its factor
        factors = torch.tensor(rope.param("freq_factors"), dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors: {factors.numel()} factors for {inv_freq.numel()} frequencies")
        return inv_freq / factors, 1.0
    return _yarn(rope, max_position_embeddings)


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    factor = rope.param("factor")
    low_freq_factor = rope.param("low_freq_factor")
    high_freq_factor = rope.param("high_freq_factor")
    old_context_len = rope.param("original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    dim, base = rope.dim, rope.theta
    original = rope.param("original_max_position_embeddings", max_position_embeddings)
    factor = rope.param("factor")
    if factor is None:
        factor = max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.param("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.param("mscale"), rope.param("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.param("beta_fast") or 32
    beta_slow = rope.param("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.param("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``apply`` rotates q or k at given positions."""

    def __init__(self, rope: RopeConfig, max_position_embeddings: int) -> None:
        inv_freq, self.attention_factor = rope_inv_freq(rope, max_position_embeddings)
        self.inv_freq = inv_freq
        self.interleaved = rope.interleaved
        self.dim = rope.dim

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, R/2] (already scaled by the attention factor)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, T, R/2]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, R]; cos/sin [B, T, R/2]."""
        return rotate(x, cos, sin, interleaved=self.interleaved)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """x [B, H, T, R] rotated by cos/sin [B, T, R/2]: pairs (x0, x1), (x2, x3)... when ``interleaved``, else the
    halves (x_i, x_{i + R/2}). Interleaved pairs come out as [evens | odds] (as transformers' interleaved rope):
    the same for queries and keys, so their products are the model's."""
    cos, sin = cos[:, None], sin[:, None]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
