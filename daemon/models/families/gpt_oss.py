"""gpt-oss: attention sinks, alternating sliding windows, top-k softmax routing, clamped SwiGLU, MXFP4 experts."""

from __future__ import annotations

from moed.layers.layer_config import MoeConfig
from moed.models.families.base import Family, FamilyNames, base_config, expert_count, mha, windows
from moed.models.model_config import ModelConfig, require


def _parse_gpt_oss(cfg: dict) -> ModelConfig:
    n = require(cfg, "num_hidden_layers")
    att = mha(cfg, has_qkv_bias=True, has_o_bias=True, has_sinks=True)
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "intermediate_size"), scoring="topk_softmax",
                    has_router_bias=True, activation="gpt_oss", has_expert_bias=True,
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    return base_config(cfg, att, moe, (True,) * n, windows(cfg, n, all_layers_default=False), att.head_dim)


FAMILIES = (
    Family("gpt_oss", _parse_gpt_oss, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="router", router_bias="router.bias",
        expert_gate="", expert_up="", expert_down="",
        fused_gate_up="experts.gate_up_proj", fused_down="experts.down_proj"),
        architectures=("GptOssForCausalLM",), tool_format="harmony"),
)
