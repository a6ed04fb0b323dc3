"""Qwen2-MoE and Qwen3-MoE: GQA attention (q/k/v biases; Qwen3 per-head q/k norms), softmax routing, Qwen2's sigmoid-gated shared expert."""

from __future__ import annotations

from moed.layers.layer_config import MoeConfig
from moed.models.families.base import (Family, FamilyNames, base_config, check_act, expert_count, mha,
                                       qwen_moe_layers, windows)
from moed.models.model_config import ModelConfig, require


def _parse_qwen2_moe(cfg: dict) -> ModelConfig:
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = mha(cfg, has_qkv_bias=bool(cfg.get("qkv_bias", True)))
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "moe_intermediate_size"), scoring="softmax",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                    has_shared_expert_gate=True)
    return base_config(cfg, att, moe, qwen_moe_layers(cfg, n), windows(cfg, n, all_layers_default=False), att.head_dim)


def _parse_qwen3_moe(cfg: dict) -> ModelConfig:
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = mha(cfg, has_qkv_bias=bool(cfg.get("attention_bias", False)),
              has_o_bias=bool(cfg.get("attention_bias", False)), qk_norm="per_head")
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "moe_intermediate_size"), scoring="softmax",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    return base_config(cfg, att, moe, qwen_moe_layers(cfg, n), windows(cfg, n, all_layers_default=False), att.head_dim)


FAMILIES = (
    Family("qwen2_moe", _parse_qwen2_moe, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", shared="shared_expert", shared_gate="shared_expert_gate"),
        architectures=("Qwen2MoeForCausalLM",), tool_format="hermes"),
    Family("qwen3_moe", _parse_qwen3_moe, FamilyNames(moe_prefix="model.layers.{i}.mlp", router="gate"),
           architectures=("Qwen3MoeForCausalLM",), tool_format="qwen3"),
)
