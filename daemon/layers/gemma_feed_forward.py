"""Gemma-4's layer after its attention: sandwich norms, a dense GeGLU MLP beside the experts, a layer output scale.

With r = x + norm_pa(attention) (the attention output is normed before the residual add):

    m  = mlp(norm_pf(r))                                          every layer
    m  = norm_pf1(m) + norm_pf2(experts(norm_pf2'(r)))            MoE layers: the router reads rms(r) (no weight)
    x' = (r + norm_post(m)) * layer_scalar

Every norm is ``x * w`` (Gemma-4's RMSNorm; Gemma 2/3's were ``x * (1 + w)``). The experts and the dense MLP take
the same residual through their own pre-norms and run in parallel, not one after the other; the router's own
input scale and per-expert scales are the MoE layer's (layers/moe.py).
"""

from __future__ import annotations

import torch

from moed.layers.dense_mlp import DenseMlp
from moed.layers.moe import MoeLayer
from moed.layers.norms import rms_norm


class GemmaFeedForward:
    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, eps: float, moe: MoeLayer | None,
                 activation: str = "gelu_tanh") -> None:
        get = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        self.eps, self.moe = eps, moe
        self.post_attention = get("post_attention_layernorm.weight")
        self.pre_mlp, self.post = get("pre_feedforward_layernorm.weight"), get("post_feedforward_layernorm.weight")
        self.mlp = DenseMlp(weights, f"{prefix}.mlp", activation)
        self.scalar = weights.get(f"{prefix}.layer_scalar")
        if moe is not None:
            self.post_mlp = get("post_feedforward_layernorm_1.weight")
            self.pre_moe, self.post_moe = get("pre_feedforward_layernorm_2.weight"), get("post_feedforward_layernorm_2.weight")
            self.unit = torch.ones_like(self.post_moe, dtype=torch.float32)

    def forward(self, x: torch.Tensor, attention_out: torch.Tensor, valid: torch.Tensor, all_valid: bool
                ) -> torch.Tensor:
        """x [R, T, D] the residual before the attention, attention_out its output -> the layer's output. ``valid``
        [R, T]: the real tokens (padding must not reach the experts)."""
        eps = self.eps
        r = x + rms_norm(attention_out, self.post_attention, eps)
        m = self.mlp.forward(rms_norm(r, self.pre_mlp, eps))
        if self.moe is not None:
            m = rms_norm(m, self.post_mlp, eps)
            experts_in, route_in = rms_norm(r, self.pre_moe, eps), rms_norm(r, self.unit, eps)
            d = r.shape[-1]
            if all_valid:
                routed = self.moe.forward(experts_in.reshape(-1, d), route_in.reshape(-1, d)).view(r.shape)
            else:
                routed = torch.zeros_like(r)
                routed[valid] = self.moe.forward(experts_in[valid], route_in[valid])
            m = m + rms_norm(routed, self.post_moe, eps)
        out = r + rms_norm(m, self.post, eps)
        return out if self.scalar is None else out * self.scalar.to(out.dtype)
