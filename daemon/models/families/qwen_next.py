"""Qwen3-Next and Qwen3.5-MoE (Qwen3.6-35B-A3B): gated DeltaNet layers between gated attention layers."""

from __future__ import annotations

import dataclasses

from moed.errors import ModelFormatError
from moed.layers.gated_deltanet import DeltaNetConfig
from moed.layers.layer_config import MoeConfig
from moed.models.families.base import (Family, FamilyNames, base_config, check_act, expert_count, language_config, mha,
                                       qwen_moe_layers)
from moed.models.model_config import ModelConfig, require


def _parse_qwen3_next(cfg: dict) -> ModelConfig:
    """Qwen3-Next: gated DeltaNet layers (``layer_types`` "linear_attention") between gated full-attention
    layers (per-head (1 + w) q/k norms, partial rotary); Qwen2-MoE-style experts with a sigmoid-gated
    shared expert; every RMSNorm but the DeltaNet's output norm scales by (1 + w)."""
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    types = cfg.get("layer_types") or []
    if len(types) != n or any(t not in ("linear_attention", "full_attention") for t in types):
        raise ModelFormatError(f"config.json: layer_types must give linear_attention or full_attention for each of "
                               f"the {n} layers")
    bias = bool(cfg.get("attention_bias", False))
    att = mha(cfg, has_qkv_bias=bias, has_o_bias=bias, qk_norm="per_head", gated=True)
    try:
        linear = DeltaNetConfig(num_k_heads=require(cfg, "linear_num_key_heads"),
                                num_v_heads=require(cfg, "linear_num_value_heads"),
                                k_head_dim=require(cfg, "linear_key_head_dim"),
                                v_head_dim=require(cfg, "linear_value_head_dim"),
                                conv_kernel=require(cfg, "linear_conv_kernel_dim"),
                                eps=float(cfg.get("rms_norm_eps", 1e-6)))
    except ValueError as exc:
        raise ModelFormatError(f"config.json: {exc}") from exc
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "moe_intermediate_size"), scoring="softmax",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                    has_shared_expert_gate=True)
    base = base_config(cfg, att, moe, qwen_moe_layers(cfg, n), (None,) * n, att.head_dim)
    return dataclasses.replace(base, linear_attention=linear,
                               linear_layers=tuple(t == "linear_attention" for t in types), norm_offset=1.0)


def _parse_qwen3_5_moe_text(cfg: dict) -> ModelConfig:
    """Qwen3.5-MoE's language model (Qwen3.6-35B-A3B's architecture): Qwen3-Next's layers, with the
    DeltaNet's input projections as four plain matrices. (For text, its multimodal rotary embedding is
    the ordinary one: every position section holds the same index.)"""
    config = _parse_qwen3_next(cfg)
    return dataclasses.replace(config, linear_attention=dataclasses.replace(config.linear_attention,
                                                                            split_projections=True))


def _parse_qwen3_5_moe(cfg: dict) -> ModelConfig:
    """The multimodal Qwen3.5-MoE checkpoint (Qwen3_5MoeForConditionalGeneration, e.g. Qwen3.6-35B-A3B as
    shipped): its language model only, from ``text_config``; the vision tower is not loaded (text in,
    text out)."""
    return _parse_qwen3_5_moe_text(language_config(cfg, "qwen3_5_moe"))


QWEN_NEXT_NAMES = FamilyNames(moe_prefix="model.layers.{i}.mlp", router="gate", shared="shared_expert",
                              shared_gate="shared_expert_gate")


FAMILIES = (
    # their templates write Qwen3's <tool_call> blocks (Hermes JSON, or Qwen3-Coder's XML for Qwen3.5/3.6) and <think>
    Family("qwen3_next", _parse_qwen3_next, QWEN_NEXT_NAMES, architectures=("Qwen3NextForCausalLM",),
           tool_format="qwen3"),
    Family("qwen3_5_moe_text", _parse_qwen3_5_moe_text, QWEN_NEXT_NAMES, architectures=("Qwen3_5MoeForCausalLM",),
           tool_format="qwen3"),
    Family("qwen3_5_moe", _parse_qwen3_5_moe, FamilyNames(
        moe_prefix="model.language_model.layers.{i}.mlp", router="gate", shared="shared_expert",
        shared_gate="shared_expert_gate", language_prefix="model.language_model.",
        skip_prefixes=("model.visual.", "mtp.")), architectures=("Qwen3_5MoeForConditionalGeneration",),
        tool_format="qwen3"),
)
