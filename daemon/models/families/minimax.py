"""MiniMax-M2 / M2.1 / M2.5 (``minimax_m2``, 230B-A10B): GQA attention with q/k RMS norms over the whole projection
and partial rotary (``rotary_dim`` of each head, rotate-half), sigmoid routing chosen with a correction bias and
renormalised, an MoE in every layer, no shared expert. Tool calls are XML invokes in ``<minimax:tool_call>``
with interleaved ``<think>`` reasoning (``text/output_parsers/minimax.py``)."""

from __future__ import annotations

from moed.errors import UnsupportedModelError
from moed.layers.layer_config import MoeConfig
from moed.models.families.base import Family, FamilyNames, base_config, check_act, expert_count, mha
from moed.models.model_config import ModelConfig, require


def _parse_minimax_m2(cfg: dict) -> ModelConfig:
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    types = cfg.get("attn_type_list")
    if types is not None and any(t != 1 for t in types):
        raise UnsupportedModelError("config.json: attn_type_list names lightning (linear) attention layers "
                                    "(MiniMax-M1 / Text-01); moed runs MiniMax-M2's all-softmax-attention layers only")
    if cfg.get("postnorm"):
        raise UnsupportedModelError("config.json: postnorm is true; MiniMax-M2 checkpoints are pre-norm")
    if int(cfg.get("shared_intermediate_size") or 0):
        raise UnsupportedModelError("config.json: shared_intermediate_size is set; MiniMax-M2 has no shared expert "
                                    "and moed knows no tensor names for one")
    att = mha(cfg, qk_norm="full" if cfg.get("use_qk_norm", True) else "none")
    rope_cfg = dict(cfg)
    rotary = cfg.get("rotary_dim")
    params = cfg.get("rope_parameters") or {}
    if rotary and "partial_rotary_factor" not in params and "partial_rotary_factor" not in cfg:
        rope_cfg["partial_rotary_factor"] = int(rotary) / att.head_dim  # the released configs' legacy field
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "intermediate_size"), scoring="sigmoid", norm_topk_prob=True,
                    has_score_correction_bias=True)
    return base_config(rope_cfg, att, moe, (True,) * n, (None,) * n, att.head_dim)


FAMILIES = (
    Family("minimax_m2", _parse_minimax_m2, FamilyNames(
        moe_prefix="model.layers.{i}.block_sparse_moe", router="gate", score_bias="e_score_correction_bias",
        expert_gate="experts.{e}.w1.weight", expert_up="experts.{e}.w3.weight", expert_down="experts.{e}.w2.weight"),
        architectures=("MiniMaxM2ForCausalLM",), tool_format="minimax"),
)
