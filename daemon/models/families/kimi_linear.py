"""Moonshot Kimi-Linear (48B-A3B): Kimi Delta Attention layers (layers/kda.py) between MLA layers that use no
rotary embedding, DeepSeek-V3's experts (sigmoid scores chosen with a correction bias, renormalised and scaled,
a shared expert; the first layer dense).

- The layer pattern: ``linear_attn_config.kda_layers`` / ``full_attn_layers`` (1-based layer numbers; they win
  over ``layer_types``, whose fallback is not the released pattern).
- config.json names some fields its own way (``num_experts_per_token``, ``num_shared_experts``,
  ``num_expert_group``, ``moe_renormalize``, ``model_max_length``): read under DeepSeek-V3's names.
- The KDA layers keep their tensors under ``self_attn`` as the MLA ones do: read as moed's ``linear_attn``
  (``ModelConfig.tensor_renames``, from the pattern). transformers' save_pretrained writes the dense first layer's
  MLP under ``block_sparse_moe``; Moonshot's checkpoints under ``mlp``: both are read.
- The MLA's latent norm has its own epsilon (1e-6) beside the model's (1e-5).
- Tool calls: Moonshot's section tokens (text/output_parsers/kimi.py), as Kimi-K2's.
- Kimi-K3's fields (``gate_lower_bound``, ``use_full_rank_gate``, ``mla_use_output_gate``...) and
  ``mla_use_nope: false`` are refused: transformers would run them wrong, and so would moed.
"""

from __future__ import annotations

import dataclasses

from moed.errors import ModelFormatError, UnsupportedModelError
from moed.layers.kda import KdaConfig
from moed.models.families.base import Family, FamilyNames
from moed.models.families.deepseek import deepseek_v3_config
from moed.models.model_config import ModelConfig

ALIASES = {"num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
           "num_expert_group": "n_group", "moe_renormalize": "norm_topk_prob", "num_experts": "n_routed_experts",
           "model_max_length": "max_position_embeddings"}
K3_FIELDS = ("gate_lower_bound", "use_full_rank_gate", "safe_gate")


def _linear_layers(cfg: dict, n: int) -> list[bool]:
    lin = cfg.get("linear_attn_config") or {}
    kda, full = lin.get("kda_layers"), lin.get("full_attn_layers")
    if kda is not None and full is not None:
        numbers = sorted([*kda, *full])
        if numbers != list(range(1, n + 1)):
            raise ModelFormatError(f"config.json: linear_attn_config's kda_layers and full_attn_layers must number "
                                   f"each of the {n} layers once (from 1)")
        return [i + 1 in set(kda) for i in range(n)]
    types = cfg.get("layer_types")
    if not isinstance(types, list) or len(types) != n or any(t not in ("linear_attention", "full_attention")
                                                             for t in types):
        raise ModelFormatError(f"config.json: linear_attn_config (kda_layers, full_attn_layers) or layer_types must "
                               f"give each of the {n} layers' attention")
    return [t == "linear_attention" for t in types]


def _parse_kimi_linear(cfg: dict) -> ModelConfig:
    lin = cfg.get("linear_attn_config") or {}
    if any(lin.get(key) for key in K3_FIELDS) or cfg.get("mla_use_output_gate") or cfg.get("attn_res_block_size"):
        raise UnsupportedModelError("config.json: Kimi-K3 fields (gate_lower_bound, use_full_rank_gate, "
                                    "mla_use_output_gate...) are set; moed runs Kimi-Linear's layers")
    if cfg.get("mla_use_nope") is False:
        raise UnsupportedModelError("config.json: mla_use_nope is false; Kimi-Linear's MLA layers use no rotary "
                                    "embedding and moed runs them so")
    cfg = dict(cfg)
    for alias, name in ALIASES.items():
        if alias in cfg and name not in cfg:
            cfg[name] = cfg[alias]
    cfg.setdefault("first_k_dense_replace", 1)
    cfg.setdefault("rope_interleave", False)  # unused: no rotary
    base = deepseek_v3_config(cfg)
    n = base.num_layers
    linear = _linear_layers(cfg, n)
    try:
        kda = KdaConfig(num_heads=int(lin.get("num_heads", 32)), head_dim=int(lin.get("head_dim", 128)),
                        conv_kernel=int(lin.get("short_conv_kernel_size", 4)), eps=base.rms_norm_eps)
    except (TypeError, ValueError) as exc:
        raise ModelFormatError(f"config.json: linear_attn_config: {exc}") from exc
    attention = dataclasses.replace(base.attention, latent_norm_eps=1e-6)
    renames = tuple((rf"^model\.layers\.{i}\.self_attn\.", f"model.layers.{i}.linear_attn.")
                    for i in range(n) if linear[i])
    return dataclasses.replace(base, attention=attention, linear_attention=kda, linear_layers=tuple(linear),
                               nope_layers=(True,) * n, tensor_renames=renames)


FAMILIES = (
    Family("kimi_linear", _parse_kimi_linear, FamilyNames(
        moe_prefix="model.layers.{i}.block_sparse_moe", router="gate", score_bias="gate.e_score_correction_bias",
        shared="shared_experts", expert_gate="experts.{e}.w1.weight", expert_up="experts.{e}.w3.weight",
        expert_down="experts.{e}.w2.weight",
        # transformers saves the dense first layer's MLP under block_sparse_moe
        renames=((r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1."),)),
        architectures=("KimiLinearForCausalLM",), tool_format="kimi"),
)
