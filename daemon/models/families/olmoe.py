"""OLMoE: q/k norms over the whole projection, q/k/v clipping, softmax routing."""

from __future__ import annotations

from moed.layers.layer_config import MoeConfig
from moed.models.families.base import Family, FamilyNames, base_config, check_act, expert_count, mha
from moed.models.model_config import ModelConfig, require


def _parse_olmoe(cfg: dict) -> ModelConfig:
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = mha(cfg, has_qkv_bias=bool(cfg.get("attention_bias", False)),
              has_o_bias=bool(cfg.get("attention_bias", False)), qk_norm="full", clip_qkv=cfg.get("clip_qkv"))
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "intermediate_size"), scoring="softmax",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return base_config(cfg, att, moe, (True,) * n, (None,) * n, att.head_dim)


FAMILIES = (
    Family("olmoe", _parse_olmoe, FamilyNames(moe_prefix="model.layers.{i}.mlp", router="gate"),
           architectures=("OlmoeForCausalLM",)),
)
