"""DeepSeek-V3 (MLA, grouped sigmoid routing with a correction bias, shared experts) and DeepSeek-V3.2 (the same
with DeepSeek Sparse Attention's lightning indexer); GLM-5 reuses ``sparse_mla``."""

from __future__ import annotations

import dataclasses
import math

from moed.errors import ModelFormatError
from moed.layers.layer_config import AttentionConfig
from moed.models.families.base import Family, FamilyNames, base_config, check_act, sigmoid_group_moe
from moed.models.model_config import ModelConfig, require, rope_from_config


def deepseek_v3_config(cfg: dict) -> ModelConfig:
    """DeepSeek-V3: MLA attention, grouped sigmoid experts (and the families built on them)."""
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    heads = require(cfg, "num_attention_heads")
    nope, rope_dim = require(cfg, "qk_nope_head_dim"), require(cfg, "qk_rope_head_dim")
    qk_head_dim = nope + rope_dim
    scaling = qk_head_dim ** -0.5
    rope = rope_from_config(cfg, rope_dim)
    if rope.rope_type != "default":
        mscale_all_dim = rope.param("mscale_all_dim", 0)
        factor = rope.param("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scaling = scaling * mscale * mscale
    att = AttentionConfig(
        kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=qk_head_dim,
        has_qkv_bias=bool(cfg.get("attention_bias", False)), has_o_bias=bool(cfg.get("attention_bias", False)),
        scaling=scaling, q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=require(cfg, "kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=require(cfg, "v_head_dim"),
    )
    moe, moe_layers = sigmoid_group_moe(cfg, n)
    return base_config(cfg, att, moe, moe_layers, (None,) * n, rope_dim,
                       interleaved=bool(cfg.get("rope_interleave", True)))


def mlp_layer_types(cfg: dict, n: int, default: tuple[bool, ...]) -> tuple[bool, ...]:
    """Which layers are MoE from config.json's ``mlp_layer_types`` ("dense" / "sparse" per layer), else
    ``default``."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ModelFormatError(f"config.json: mlp_layer_types must give dense or sparse for each of the {n} layers")
    return tuple(t == "sparse" for t in types)


def _parse_deepseek_v32(cfg: dict) -> ModelConfig:
    """DeepSeek-V3.2: DeepSeek-V3's MLA (always with a q LoRA) and experts, plus DeepSeek Sparse Attention: a
    lightning indexer per layer picks each query's ``index_topk`` keys (its rotary on halves)."""
    return sparse_mla(cfg, rope_interleaved=False, indexer_layers=())


def sparse_mla(cfg: dict, *, rope_interleaved: bool, indexer_layers: tuple[bool, ...]) -> ModelConfig:
    for key in ("q_lora_rank", "index_topk", "index_n_heads", "index_head_dim"):
        require(cfg, key)
    rope_dim = require(cfg, "qk_rope_head_dim")
    if cfg["index_head_dim"] < rope_dim:
        raise ModelFormatError(f"config.json: index_head_dim={cfg['index_head_dim']} is smaller than "
                               f"qk_rope_head_dim={rope_dim} (the indexer rotates that many dims of each head)")
    # the MLA attention always rotates pairs (its rope_interleave field is gone from these configs)
    base = deepseek_v3_config(dict(cfg, rope_interleave=True))
    n = base.num_layers
    moe_layers = mlp_layer_types(cfg, n, base.moe_layers)
    attention = dataclasses.replace(base.attention, index_topk=cfg["index_topk"], index_num_heads=cfg["index_n_heads"],
                                    index_head_dim=cfg["index_head_dim"], index_rope_interleaved=rope_interleaved)
    return dataclasses.replace(base, attention=attention, moe_layers=moe_layers, indexer_layers=indexer_layers)


DEEPSEEK_NAMES = FamilyNames(moe_prefix="model.layers.{i}.mlp", router="gate",
                             score_bias="gate.e_score_correction_bias", shared="shared_experts")


FAMILIES = (
    Family("deepseek_v3", deepseek_v3_config, DEEPSEEK_NAMES, architectures=("DeepseekV3ForCausalLM",),
           tool_format="deepseek"),
    # Kimi-K2 (model_type kimi_k2, DeepseekV3ForCausalLM): DeepSeek-V3's model, Moonshot's tool-call tokens
    Family("kimi_k2", deepseek_v3_config, DEEPSEEK_NAMES, tool_format="kimi"),
    Family("deepseek_v32", _parse_deepseek_v32, DEEPSEEK_NAMES, architectures=("DeepseekV32ForCausalLM",),
           tool_format="dsml", chat_template="deepseek_v32"),
)
