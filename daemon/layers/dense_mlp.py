"""SwiGLU MLP of dense layers and of shared experts: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moed.layers.linear import linear


class DenseMlp:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.gate = weights[f"{prefix}.gate_proj.weight"]
        self.up = weights[f"{prefix}.up_proj.weight"]
        self.down = weights[f"{prefix}.down_proj.weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)
