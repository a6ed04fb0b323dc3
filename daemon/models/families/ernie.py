"""ERNIE-4.5-MoE (``ernie4_5_moe``: ERNIE-4.5-21B-A3B, -300B-A47B and their Thinking versions): GQA attention with
GLM-style rotary on pairs, softmax routing whose top-k is chosen on the probabilities plus a correction bias
(the weights are the plain probabilities, renormalised), shared experts, MoE layers every
``moe_layer_interval`` layers between ``moe_layer_start_index`` and ``moe_layer_end_index``; the
multi-token-prediction layers are not used."""

from __future__ import annotations

from moed.errors import ModelFormatError, UnsupportedModelError
from moed.layers.layer_config import MoeConfig
from moed.models.families.base import Family, FamilyNames, base_config, check_act, mha
from moed.models.model_config import ModelConfig, require


def _int(cfg: dict, key: str, default: int) -> int:
    value = cfg.get(key, default)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(f"config.json: {key} must be an integer, got {value!r}")
    return value


def _parse_ernie4_5_moe(cfg: dict) -> ModelConfig:
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    if cfg.get("use_bias"):
        raise UnsupportedModelError("config.json: use_bias is true (biases on every linear layer); the released "
                                    "ERNIE-4.5 MoE checkpoints have none and moed's MLPs take none")
    experts, top_k = require(cfg, "moe_num_experts"), require(cfg, "moe_k")
    if isinstance(experts, list) or isinstance(top_k, list):
        raise UnsupportedModelError("config.json: per-modality expert counts (ERNIE-4.5-VL) are not supported; "
                                    "use a text ERNIE-4.5 MoE checkpoint")
    inter = require(cfg, "moe_intermediate_size")
    moe = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=inter, scoring="softmax",
                    norm_topk_prob=True, has_score_correction_bias=True,
                    shared_intermediate_size=inter * _int(cfg, "moe_num_shared_experts", 0))
    start, interval = _int(cfg, "moe_layer_start_index", 1), max(_int(cfg, "moe_layer_interval", 1), 1)
    end = _int(cfg, "moe_layer_end_index", -1)
    end = n - 1 if end == -1 else end
    moe_layers = tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n))
    att = mha(cfg)
    return base_config(cfg, att, moe, moe_layers, (None,) * n, att.head_dim, interleaved=True)


FAMILIES = (
    Family("ernie4_5_moe", _parse_ernie4_5_moe, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", score_bias="moe_statics.e_score_correction_bias",
        shared="shared_experts", skip_prefixes=("model.mtp",)),
        architectures=("Ernie4_5_MoeForCausalLM",), tool_format="qwen3"),
)
