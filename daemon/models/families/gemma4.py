"""Google Gemma-4 (26B-A4B, and the dense 31B): sliding-window layers and full-attention layers with their own head
size, KV heads and rotary; the embedding scaled by sqrt(hidden); final logits soft-capped.

- Attention: per-head q/k RMS norms (with weights) and a weightless one on the values, scale 1.0; the full layers'
  values are their key projection (``attention_k_eq_v``: no v_proj) and their rotary is "proportional" (the first
  quarter of each head's pairs rotate, at frequencies over the whole head size).
- Layers: sandwich norms, a dense GeGLU MLP in every layer and, with ``enable_moe_block``, routed GeGLU experts
  beside it (their own pre- and post-norms), then a per-layer output scale (layers/gemma_feed_forward.py). The
  router reads the weightless-normed residual times a per-channel scale and hidden^-0.5, softmax top-k renormalised,
  each weight times its expert's scale. Experts are fused ``[E, 2I, D]`` (gate rows, then up) and ``[E, D, I]``.
- Every RMSNorm is ``x * w`` (Gemma 2/3's were ``x * (1 + w)``).
- The multimodal checkpoint (Gemma4ForConditionalGeneration) loads its language model only (vision and audio
  towers are not read: text in, text out). Per-layer embeddings and KV sharing (the E2B / E4B models) are refused.
- Tool calls and reasoning: ``<|tool_call>call:NAME{...}<tool_call|>``, ``<|channel>thought ... <channel|>``
  (text/output_parsers/gemma4.py).
"""

from __future__ import annotations

import dataclasses

from moed.errors import ModelFormatError, UnsupportedModelError
from moed.layers.layer_config import MoeConfig
from moed.models.families.base import Family, FamilyNames, base_config, language_config, mha
from moed.models.model_config import ModelConfig, require, rope_from_config

SLIDING, FULL = "sliding_attention", "full_attention"


def _layer_types(cfg: dict, n: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every sixth layer full, and the last one
        types = [FULL if (i + 1) % 6 == 0 or i == n - 1 else SLIDING for i in range(n)]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ModelFormatError(f"config.json: layer_types must give sliding_attention or full_attention for each of "
                               f"the {n} layers")
    return list(types)


def _rope(cfg: dict, kind: str, head_dim: int):
    params = cfg.get("rope_parameters") or {}
    sub = params.get(kind) if isinstance(params.get(kind), dict) else params
    return rope_from_config({"rope_parameters": dict(sub)}, head_dim)


def _full_layer(cfg: dict, types: list[str]) -> tuple[int, int | None]:
    """The full layers' head size and KV heads (None: the sliding layers'): transformers saves them per layer in
    ``per_layer_config``, the released configs as ``global_head_dim`` / ``num_global_key_value_heads``."""
    per_layer = cfg.get("per_layer_config") or {}
    full = [i for i, t in enumerate(types) if t == FULL]
    if per_layer and full:
        entries = [per_layer.get(str(i)) or per_layer.get(i) or {} for i in full]
        dims = {int(e.get("head_dim") or 0) for e in entries}
        kv = {e.get("num_key_value_heads") for e in entries}
        if len(dims) != 1 or len(kv) != 1:
            raise UnsupportedModelError("config.json: per_layer_config gives full-attention layers different shapes; "
                                        "moed runs one shape for all of them")
        return dims.pop() or int(cfg.get("global_head_dim") or 512), kv.pop()
    kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    return int(cfg.get("global_head_dim") or 512), kv


def _parse_gemma4_text(cfg: dict) -> ModelConfig:
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"config.json: hidden_activation {act!r}; moed runs Gemma-4's gelu_pytorch_tanh")
    if cfg.get("hidden_size_per_layer_input", 256):
        raise UnsupportedModelError("config.json: hidden_size_per_layer_input is set (per-layer embeddings: Gemma-4 "
                                    "E2B / E4B); moed runs the Gemma-4 models without them (26B-A4B, 31B)")
    if cfg.get("num_kv_shared_layers"):
        raise UnsupportedModelError("config.json: num_kv_shared_layers is set (KV sharing: Gemma-4 E2B / E4B); moed "
                                    "runs the Gemma-4 models without it")
    if cfg.get("use_double_wide_mlp"):
        raise UnsupportedModelError("config.json: use_double_wide_mlp is set; moed runs Gemma-4 26B-A4B / 31B")
    if cfg.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("config.json: use_bidirectional_attention is 'all' (an encoder); moed runs causal "
                                    "language models")
    n = require(cfg, "num_hidden_layers")
    types = _layer_types(cfg, n)
    window = require(cfg, "sliding_window")
    sliding = dataclasses.replace(mha(cfg, qk_norm="per_head", v_norm=True), scaling=1.0)
    full_dim, full_kv = _full_layer(cfg, types)
    full = dataclasses.replace(sliding, head_dim=full_dim, num_kv_heads=int(full_kv or sliding.num_kv_heads),
                               k_eq_v=bool(cfg.get("attention_k_eq_v", False)))
    if full.num_heads % full.num_kv_heads:
        raise ModelFormatError(f"config.json: {full.num_heads} attention heads are not a multiple of the full layers' "
                               f"{full.num_kv_heads} KV heads")
    hidden = require(cfg, "hidden_size")
    experts = bool(cfg.get("enable_moe_block", False))
    moe = MoeConfig(num_experts=require(cfg, "num_experts") if experts else 1,
                    top_k=require(cfg, "top_k_experts") if experts else 1,
                    intermediate_size=require(cfg, "moe_intermediate_size") if experts else 1, scoring="softmax",
                    norm_topk_prob=True, activation="gelu_tanh", router_input_scale=hidden ** -0.5)
    base = base_config(dict(cfg, tie_word_embeddings=cfg.get("tie_word_embeddings", True)), sliding, moe,
                       (experts,) * n, tuple(window if t == SLIDING else None for t in types), sliding.head_dim,
                       dense_intermediate=require(cfg, "intermediate_size"))
    return dataclasses.replace(
        base, rope=_rope(cfg, SLIDING, sliding.head_dim), full_attention=full, full_rope=_rope(cfg, FULL, full_dim),
        scale_embedding=True, final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
        layer_recipe="gemma4", mlp_activation="gelu_tanh")


def _parse_gemma4(cfg: dict) -> ModelConfig:
    """Gemma4ForConditionalGeneration: its language model, from ``text_config``."""
    return _parse_gemma4_text(language_config(cfg, "gemma4", outer_tie=True))


def _names(prefix: str, **kw) -> FamilyNames:
    # the router and the experts sit beside the dense MLP, directly in the layer: read under "moe." so that the MoE
    # parts are told from the rest of the layer
    return FamilyNames(moe_prefix=prefix + "layers.{i}.moe", router="router.proj", router_input_scale="router.scale",
                       router_expert_scale="router.per_expert_scale", fused_gate_up="experts.gate_up_proj",
                       fused_down="experts.down_proj", fused_interleaved=False, fused_transposed=True,
                       renames=((r"\.layers\.(\d+)\.(router|experts)\.", r".layers.\1.moe.\2."),), **kw)


FAMILIES = (
    Family("gemma4_text", _parse_gemma4_text, _names("model."), architectures=("Gemma4ForCausalLM",),
           tool_format="gemma4"),
    Family("gemma4", _parse_gemma4, _names(
        "model.language_model.", language_prefix="model.language_model.",
        skip_prefixes=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")),
        architectures=("Gemma4ForConditionalGeneration",), tool_format="gemma4"),
)
