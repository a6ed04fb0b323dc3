"""``linear``: y = x W^T + b for float32 activations and weights kept in the checkpoint's dtype.

With float32 weights it is plain F.linear. With bf16/fp16 weights the activations are rounded to
the weights' dtype and multiplied there (oneDNN/cuBLAS accumulate in float32), and the result comes
back as float32: what llama.cpp does for bf16 weights, at half the bytes per weight of float32.
The bias, if any, is added in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32, weight [N, K] -> [..., N] float32."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(weight.dtype), weight).float()
    return out if bias is None else out + bias.float()
