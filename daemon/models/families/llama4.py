"""Llama-4 (Scout 17B-16E, Maverick 17B-128E): chunked local attention with rotary on three layers of four, full
attention without rotary (NoPE, with a query temperature) on the fourth; a weightless per-head q/k RMS norm on the
rotary layers; interleaved (complex) rotary with llama3 scaling; one routed expert per token whose sigmoid score
scales the expert's input, beside a shared expert; MoE layers every ``interleave_moe_layer_step`` (dense MLPs of
``intermediate_size_mlp`` between). The multimodal checkpoint (``Llama4ForConditionalGeneration``) loads its
language model only (the vision tower is not read: text in, text out)."""

from __future__ import annotations

import dataclasses

from moed.errors import ModelFormatError, UnsupportedModelError
from moed.layers.layer_config import MoeConfig
from moed.models.families.base import Family, FamilyNames, base_config, check_act, expert_count, language_config, mha
from moed.models.model_config import ModelConfig, require


def _per_layer(cfg: dict, key: str, n: int) -> list | None:
    value = cfg.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        raise ModelFormatError(f"config.json: {key} must list one entry for each of the {n} layers")
    return value


def _parse_llama4_text(cfg: dict) -> ModelConfig:
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    top_k = int(cfg.get("num_experts_per_tok", 1))
    if top_k != 1:
        raise UnsupportedModelError(f"config.json: num_experts_per_tok is {top_k}; Llama-4 scales each expert's input "
                                    "by its router score, which moed runs for one expert per token (every released "
                                    "Llama-4 routes to one)")
    # no_rope_layers[i] is 1 where layer i USES rotary (transformers' default: every fourth layer has none)
    interval = int(cfg.get("no_rope_layer_interval", 4) or 4)
    uses_rope = _per_layer(cfg, "no_rope_layers", n) or [int((i + 1) % interval != 0) for i in range(n)]
    chunk = cfg.get("attention_chunk_size")
    types = _per_layer(cfg, "layer_types", n) or [
        "chunked_attention" if rope and chunk is not None else "full_attention" for rope in uses_rope]
    if any(t not in ("chunked_attention", "full_attention") for t in types):
        raise ModelFormatError("config.json: layer_types must be chunked_attention or full_attention")
    if "chunked_attention" in types and not (isinstance(chunk, int) and chunk > 0):
        raise ModelFormatError("config.json: chunked_attention layers need a positive attention_chunk_size")
    step = int(cfg.get("interleave_moe_layer_step", 1) or 1)
    moe_ids = cfg.get("moe_layers")
    moe_ids = set(moe_ids) if moe_ids is not None else set(range(step - 1, n, step))
    bias = bool(cfg.get("attention_bias", False))
    temperature = ()
    if cfg.get("attn_temperature_tuning", True):
        temperature = (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1)))
    att = mha(cfg, has_qkv_bias=bias, has_o_bias=bias, nope_temperature=temperature,
              qk_norm="weightless" if cfg.get("use_qk_norm", True) else "none")
    inter = require(cfg, "intermediate_size")
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=1, intermediate_size=inter, scoring="sigmoid",
                    norm_topk_prob=False, shared_intermediate_size=inter, weight_input=True)
    moe_layers = tuple(i in moe_ids for i in range(n))
    dense = int(cfg.get("intermediate_size_mlp") or 0) if not all(moe_layers) else inter
    if not dense:
        raise ModelFormatError("config.json: the dense layers need intermediate_size_mlp")
    base = base_config(cfg, att, moe, moe_layers, (None,) * n, att.head_dim, interleaved=True,
                       dense_intermediate=dense)
    return dataclasses.replace(base, attention_chunks=tuple(chunk if t == "chunked_attention" else None for t in types),
                               nope_layers=tuple(not rope for rope in uses_rope))


def _parse_llama4(cfg: dict) -> ModelConfig:
    """Llama4ForConditionalGeneration: its language model, from ``text_config``."""
    return _parse_llama4_text(language_config(cfg, "llama4"))


# transformers names the MLP part "feed_forward": read as moed's "mlp"
_FEED_FORWARD = ((r"\.layers\.(\d+)\.feed_forward\.", r".layers.\1.mlp."),)


def _names(prefix: str, **kw) -> FamilyNames:
    return FamilyNames(moe_prefix=prefix + "layers.{i}.mlp", router="router", shared="shared_expert",
                       fused_gate_up="experts.gate_up_proj", fused_down="experts.down_proj", fused_interleaved=False,
                       renames=_FEED_FORWARD, **kw)


FAMILIES = (
    Family("llama4_text", _parse_llama4_text, _names("model."), architectures=("Llama4ForCausalLM",),
           tool_format="llama4"),
    Family("llama4", _parse_llama4, _names(
        "language_model.model.", language_prefix="language_model.model.", lm_head="language_model.lm_head.weight",
        skip_prefixes=("vision_model.", "multi_modal_projector.")),
        architectures=("Llama4ForConditionalGeneration",), tool_format="llama4"),
)
