"""q8_0 K/V: llama.cpp's Q8_0 blocks (32 values -> 32 int8 + one fp16 scale), the torch reference.

For every 32 consecutive values of a row: ``d = max|x| / 127``, ``q = round(x / d)`` (half away from
zero, as C's ``roundf``; 0 where d is 0), ``d`` stored as float16; ``x ~ q * d``. This is ggml's
``quantize_row_q8_0_ref`` and the ``gguf`` package's ``quants.quantize(..., Q8_0)`` (the tests
compare against it). The pool keeps q and d as two tensors per entry (``name`` int8 and
``name + SCALE_SUFFIX`` float16 ``[..., D / 32]``): 8.5 bits per value instead of bf16's 16. The
native decode kernel (native/cpu/attn_decode_body.h) writes and reads the same bits.
"""

from __future__ import annotations

import torch

QK = 32  # values per block
SCALE_SUFFIX = "_scale"


def check_row_size(name: str, size: int) -> None:
    if size % QK:
        raise ValueError(f"q8_0 K/V needs rows of a multiple of {QK} values; the cache entry {name!r} has {size} "
                         "(choose --kv-type bf16 for this model)")


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (D a multiple of 32) -> (q int8 ``[..., D]``, d float16 ``[..., D / 32]``)."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    scaled = blocks * inv[..., None]
    mag = scaled.abs()
    whole = torch.floor(mag)
    q = torch.sign(scaled) * (whole + torch.floor(2.0 * (mag - whole)))  # roundf: half away from zero, exact
    return q.to(torch.int8).reshape(x.shape), d.to(torch.float16)


def dequantize(q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q int8 ``[..., D]``, d ``[..., D / 32]``) -> ``[..., D]`` in ``dtype``."""
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // QK, QK).float() * d.float()[..., None]
    return blocks.reshape(q.shape).to(dtype)


def bytes_per_value() -> float:
    return 1.0 + 2.0 / QK
