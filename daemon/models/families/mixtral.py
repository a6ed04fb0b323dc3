"""Mixtral (and Mixtral-shaped upcycles): GQA attention, softmax top-k over every layer's experts."""

from __future__ import annotations

from moed.layers.layer_config import MoeConfig
from moed.models.families.base import Family, FamilyNames, base_config, check_act, expert_count, mha, windows
from moed.models.model_config import ModelConfig, require


def _parse_mixtral(cfg: dict) -> ModelConfig:
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = mha(cfg)
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "intermediate_size"), scoring="softmax", norm_topk_prob=True)
    return base_config(cfg, att, moe, (True,) * n, windows(cfg, n, all_layers_default=True), att.head_dim)


FAMILIES = (
    Family("mixtral", _parse_mixtral, FamilyNames(
        moe_prefix="model.layers.{i}.block_sparse_moe", router="gate",
        expert_gate="experts.{e}.w1.weight", expert_up="experts.{e}.w3.weight", expert_down="experts.{e}.w2.weight"),
        architectures=("MixtralForCausalLM",), tool_format="mistral"),
)
