"""SwiGLU MLP of dense layers and of shared experts: down(silu(gate(x)) * up(x)) (Gemma-4's GeGLU with gelu; Nemotron-H's
down(relu(up(x))^2)).

At decode (a few rows on the CPU) the SwiGLU is the native one (``native_cpu.swiglu``, the MoE
kernel's arithmetic), so the native decode chain (models/decode_chain.py) gives the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moed.kernels.native_cpu import MAX_TOKENS, native
from moed.layers.linear import linear


def decode_rows(x: torch.Tensor) -> bool:
    """Whether ``x [..., D]`` is a decode-sized float32 CPU batch the native elementwise kernels take."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and 0 < x.numel() <= MAX_TOKENS * x.shape[-1]
            and native() is not None)


class DenseMlp:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, activation: str = "silu") -> None:
        """``activation``: "silu" (SwiGLU), "gelu_tanh" (Gemma-4's GeGLU: gelu(gate, tanh approximation) * up) or
        "relu2" (Nemotron-H: down(relu(up(x))^2), no gate)."""
        self.activation = activation
        self.gated = activation != "relu2"
        self.gate = weights[f"{prefix}.gate_proj.weight"] if self.gated else None
        self.up = weights[f"{prefix}.up_proj.weight"]
        self.down = weights[f"{prefix}.down_proj.weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return linear(F.relu(linear(x, self.up)).square(), self.down)
        g, u = linear(x, self.gate), linear(x, self.up)
        if self.activation == "gelu_tanh":
            return linear(F.gelu(g, approximate="tanh") * u, self.down)
        h = native().swiglu(g, u) if decode_rows(g) else F.silu(g) * u
        return linear(h, self.down)
