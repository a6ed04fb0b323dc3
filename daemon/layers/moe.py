"""The MoE layer: router (softmax / sigmoid or sqrt-softplus with group-limited top-k / top-k softmax / a token-id
table), then the executor.

Shapes: N routed tokens, D hidden, E experts, A experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moed.experts.executor import ExpertExecutor
from moed.kernels.native_cpu import MAX_TOKENS, native
from moed.layers.dense_mlp import DenseMlp, decode_rows
from moed.layers.linear import linear, linear_f32
from moed.layers.layer_config import MoeConfig


def route(cfg: MoeConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          score_bias: torch.Tensor | None, *, token_ids: torch.Tensor | None = None,
          table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (topk_ids [N, A] int64, topk_weights [N, A] f32). ``table`` (DeepSeek-V4's hash layers,
    int ``[V, A]``): the experts are the row of each token in ``token_ids [N]``, the scores still weigh them."""
    native_ok = score_bias is None  # the native router has no correction bias (ERNIE's softmax + bias)
    if cfg.scoring in ("softmax", "topk_softmax") and native_ok and _native_router(x, weight, bias):
        # decode: logits, softmax and top-k in one native call (native/cpu/router.c; this code is its reference)
        return native().route(x, weight, bias, cfg.scoring, cfg.top_k,
                              cfg.scoring == "softmax" and bool(cfg.norm_topk_prob))
    # routing decides which experts run: always float32, whatever dtype the router is stored in
    logits = linear_f32(x, weight, bias)  # [N, E]
    if cfg.scoring in ("softmax", "topk_softmax") and native_ok and _native_select(logits):
        # decode with a bf16 router: its logits from the dense GEMV, then the native router's own choice
        return native().route_select(logits, cfg.scoring, cfg.top_k, cfg.scoring == "softmax" and bool(cfg.norm_topk_prob))
    if cfg.scoring == "topk_softmax":  # gpt-oss: softmax over the chosen logits only
        values, ids = torch.topk(logits, cfg.top_k, dim=-1)
        return ids, torch.softmax(values, dim=-1)
    if cfg.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)
        if score_bias is not None:  # ERNIE-4.5: chosen on probabilities + bias, weighed by the probabilities
            ids = torch.topk(probs + score_bias.reshape(1, -1), cfg.top_k, dim=-1).indices
            weights = probs.gather(1, ids)
        else:
            weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights
    # sigmoid (DeepSeek-V3) or sqrt(softplus) (DeepSeek-V4) scores, chosen by score + correction bias, group-limited
    scores = logits.sigmoid() if cfg.scoring == "sigmoid" else F.softplus(logits).sqrt()
    if table is not None:
        ids = table[token_ids.reshape(-1).to(table.device)].long()
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) if cfg.norm_topk_prob else weights
        return ids, weights * cfg.routed_scaling_factor
    choice = scores + score_bias if score_bias is not None else scores
    if cfg.num_groups > 1:
        grouped = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        group_idx = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        score_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, cfg.num_experts)
        choice = choice.masked_fill(score_mask == 0, float("-inf"))
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def _native_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (0 < x.shape[0] <= MAX_TOKENS and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu"
            and isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.is_contiguous()
            and weight.device.type == "cpu" and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and native() is not None)


def _native_select(logits: torch.Tensor) -> bool:
    return (0 < logits.shape[0] <= MAX_TOKENS and logits.dim() == 2 and logits.dtype == torch.float32
            and logits.device.type == "cpu" and native() is not None)


class MoeLayer:
    def __init__(self, cfg: MoeConfig, weights: dict[str, torch.Tensor], prefix: str, moe_layer: int,
                 executor: ExpertExecutor) -> None:
        self.cfg, self.moe_layer, self.executor = cfg, moe_layer, executor
        self.router = weights[f"{prefix}.router.weight"]
        self.router_bias = weights.get(f"{prefix}.router.bias")
        self.score_bias = weights.get(f"{prefix}.router.score_bias")
        # Gemma-4: the router reads its input times a per-channel scale (folded into its rows here, in float32) and
        # each chosen expert's weight is multiplied by that expert's scale
        input_scale = weights.get(f"{prefix}.router.input_scale")
        if input_scale is not None or cfg.router_input_scale != 1.0:
            scale = (input_scale.float() if input_scale is not None else 1.0) * cfg.router_input_scale
            self.router = (self.router.float() * scale).contiguous()
        self.expert_scale = weights.get(f"{prefix}.router.expert_scale")
        shared_activation = "relu2" if cfg.activation == "relu2" else "silu"
        self.shared = DenseMlp(weights, f"{prefix}.shared", shared_activation) if cfg.shared_intermediate_size else None
        self.shared_gate = weights.get(f"{prefix}.shared_gate.weight")

    def forward(self, x: torch.Tensor, route_input: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, D] (real tokens only, no padding) -> [N, D]. ``route_input`` [N, D]: what the router reads, when it
        is not the experts' input (Gemma-4)."""
        ids, weights = route(self.cfg, x if route_input is None else route_input, self.router, self.router_bias,
                             self.score_bias)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale.float()[ids]
        if self.cfg.weight_input:  # Llama-4 (one expert per token): expert(w * x) with weight 1
            out = self.executor.run(self.moe_layer, x * weights.to(x.dtype), ids, torch.ones_like(weights, dtype=x.dtype))
        else:
            out = self.executor.run(self.moe_layer, x, ids, weights.to(x.dtype))
        if self.shared is not None:
            shared = self.shared.forward(x)
            if self.shared_gate is not None:
                z = linear(x, self.shared_gate)  # [N, 1]
                shared = native().sigmoid_scale(z, shared) if decode_rows(shared) else torch.sigmoid(z) * shared
            out = out + shared
        return out
