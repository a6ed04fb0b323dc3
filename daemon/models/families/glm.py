"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``: GQA with q/k/v biases, partial rotary, DeepSeek-V3's experts),
GLM-4.7-Flash (``glm4_moe_lite``: DeepSeek-V3's MLA and experts) and GLM-5 (``glm_moe_dsa``: DeepSeek-V3.2's sparse
MLA with shared indexer layers)."""

from __future__ import annotations

import dataclasses

from moed.errors import ModelFormatError
from moed.models.families.base import Family, base_config, check_act, mha, sigmoid_group_moe
from moed.models.families.deepseek import DEEPSEEK_NAMES, deepseek_v3_config, mlp_layer_types, sparse_mla
from moed.models.model_config import ModelConfig, require


def _parse_glm4_moe(cfg: dict) -> ModelConfig:
    """GLM-4.5 / 4.6 / 4.7 (Air): GQA attention with q/k/v biases, optional per-head q/k norms and partial
    rotary (rotate-half on the first half of each head), DeepSeek-V3's experts."""
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = mha(cfg, has_qkv_bias=bool(cfg.get("attention_bias", False)),
              qk_norm="per_head" if cfg.get("use_qk_norm") else "none")
    moe, moe_layers = sigmoid_group_moe(cfg, n)
    return base_config(cfg, att, moe, moe_layers, (None,) * n, att.head_dim)


def _parse_glm4_moe_lite(cfg: dict) -> ModelConfig:
    """GLM-4.7-Flash: DeepSeek-V3's MLA (rotary on pairs) and experts; which layers are MoE comes from
    ``mlp_layer_types`` (transformers' default: all but the first)."""
    base = deepseek_v3_config(cfg)
    n = base.num_layers
    return dataclasses.replace(base, moe_layers=mlp_layer_types(cfg, n, (False,) + (True,) * (n - 1)))


def _parse_glm_moe_dsa(cfg: dict) -> ModelConfig:
    """GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's layers with the indexer's rotary on pairs, and "shared" layers
    that reuse the top-k keys of the indexer layer before them (``indexer_types``, or the pattern / frequency
    fields it is derived from)."""
    n = require(cfg, "num_hidden_layers")
    types = cfg.get("indexer_types")
    if types is None:
        pattern = cfg.get("index_topk_pattern")
        if pattern is not None:
            letters = {"F": "full", "S": "shared"}
            types = [letters.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(int(cfg.get("index_topk_freq", 1) or 1), 1)
            offset = int(cfg.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in ("full", "shared") for t in types):
        raise ModelFormatError(f"config.json: indexer_types must give full or shared for each of the {n} layers")
    if types[0] != "full":
        raise ModelFormatError("config.json: indexer_types[0] must be full (a shared layer reuses an earlier "
                               "layer's indexer)")
    return sparse_mla(cfg, rope_interleaved=True, indexer_layers=tuple(t == "full" for t in types))


FAMILIES = (
    Family("glm4_moe", _parse_glm4_moe, DEEPSEEK_NAMES, architectures=("Glm4MoeForCausalLM",), tool_format="glm"),
    Family("glm4_moe_lite", _parse_glm4_moe_lite, DEEPSEEK_NAMES, architectures=("Glm4MoeLiteForCausalLM",),
           tool_format="glm"),
    Family("glm_moe_dsa", _parse_glm_moe_dsa, DEEPSEEK_NAMES, architectures=("GlmMoeDsaForCausalLM",),
           tool_format="glm"),
)
