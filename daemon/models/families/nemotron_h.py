"""NVIDIA Nemotron-H (Nemotron-3-Nano-30B-A3B): Mamba-2 blocks and a few attention blocks without positions, each
followed by an MoE (or dense) block, every block one mixer behind its own RMSNorm and residual.

The checkpoint's blocks (``backbone.layers.{b}``, kinds from ``hybrid_override_pattern`` / ``layers_block_type``:
M Mamba-2, * attention, E MoE, - dense MLP) become moed's layers by pairing each mixer block with the feed-forward
block after it: (norm_b, mixer_b, norm_b+1, ffn_b+1) is exactly x + mixer(norm_b(x)), then + ffn(norm_b+1(x)).
A mixer followed by another mixer is a layer without a feed-forward part (``ModelConfig.mlp_layers``). The block ->
layer names are ``ModelConfig.tensor_renames``, computed from the pattern.

The attention has no rotary embedding (NoPE), no biases and no q/k norm. The MoE routes as DeepSeek-V3 does (sigmoid
scores chosen with a correction bias, renormalised, scaled) to non-gated experts, down(relu(up(x))^2), beside a
shared expert of the same form (``MoeConfig.activation`` "relu2": the bank holds each expert's up matrix in its
gate half too). Tool calls are Qwen3-Coder's XML in ``<tool_call>`` with ``<think>`` reasoning (the "qwen3"
format). Nemotron-3 Super's latent MoE projections are refused.
"""

from __future__ import annotations

import dataclasses
import math

from moed.errors import ModelFormatError, UnsupportedModelError
from moed.layers.layer_config import MoeConfig
from moed.layers.mamba2 import Mamba2Config
from moed.models.families.base import Family, FamilyNames, base_config, expert_count, mha
from moed.models.model_config import ModelConfig, require

KINDS = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp",
         "mamba": "linear_attention", "attention": "full_attention"}  # the pattern's letters, legacy names
MIXERS, FEED_FORWARD = ("linear_attention", "full_attention"), ("moe", "mlp")


def block_kinds(cfg: dict) -> list[str]:
    """Each block's kind (linear_attention | full_attention | moe | mlp) from either form of the pattern."""
    pattern = cfg.get("hybrid_override_pattern")
    blocks = list(pattern) if isinstance(pattern, str) else cfg.get("layers_block_type") or cfg.get("layer_types")
    if not isinstance(blocks, list) or not blocks or any(b not in KINDS and b not in KINDS.values() for b in blocks):
        raise ModelFormatError("config.json: hybrid_override_pattern (M, *, E, -) or layers_block_type "
                               "(linear_attention, full_attention, moe, mlp) must give every block's kind")
    return [KINDS.get(b, b) for b in blocks]


def pair_blocks(kinds: list[str]) -> list[tuple[int, int | None]]:
    """moed's layers as (mixer block, feed-forward block or None)."""
    layers, b = [], 0
    while b < len(kinds):
        if kinds[b] not in MIXERS:
            raise UnsupportedModelError(f"config.json: block {b} ({kinds[b]}) follows no Mamba or attention block; "
                                        "moed pairs each feed-forward block with the mixer before it")
        ffn = b + 1 if b + 1 < len(kinds) and kinds[b + 1] in FEED_FORWARD else None
        layers.append((b, ffn))
        b += 2 if ffn is not None else 1
    return layers


def _renames(kinds: list[str], layers: list[tuple[int, int | None]]) -> tuple[tuple[str, str], ...]:
    out = [(r"^backbone\.embeddings\.", "model.embed_tokens."), (r"^backbone\.norm_f\.", "model.norm.")]
    for j, (mixer, ffn) in enumerate(layers):
        part = "linear_attn" if kinds[mixer] == "linear_attention" else "self_attn"
        out += [(rf"^backbone\.layers\.{mixer}\.norm\.", f"model.layers.{j}.input_layernorm."),
                (rf"^backbone\.layers\.{mixer}\.mixer\.", f"model.layers.{j}.{part}.")]
        if ffn is not None:
            out += [(rf"^backbone\.layers\.{ffn}\.norm\.", f"model.layers.{j}.post_attention_layernorm."),
                    (rf"^backbone\.layers\.{ffn}\.mixer\.", f"model.layers.{j}.mlp.")]
    return tuple(out)


def _time_step_limit(cfg: dict) -> tuple[float, float]:
    value = cfg.get("time_step_limit", cfg.get("mamba_dt_limit", (0.0, math.inf)))
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ModelFormatError(f"config.json: time_step_limit should be [min, max], got {value!r}")
    bounds = []
    for v in value:
        if isinstance(v, dict) and "__float__" in v:  # transformers writes infinity as {"__float__": "Infinity"}
            v = float(v["__float__"])
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelFormatError(f"config.json: time_step_limit should hold two numbers, got {value!r}")
        bounds.append(math.inf if v >= 1e30 else float(v))
    return bounds[0], bounds[1]


def _parse_nemotron_h(cfg: dict) -> ModelConfig:
    kinds = block_kinds(cfg)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if cfg.get(key, want) != want:
            raise UnsupportedModelError(f"config.json: {key} is {cfg[key]!r}; moed runs Nemotron-H's {want}")
    if cfg.get("moe_latent_size"):
        raise UnsupportedModelError("config.json: moe_latent_size is set (Nemotron-3 Super's latent MoE); moed runs "
                                    "Nemotron-H MoE blocks without latent projections (Nemotron-3 Nano)")
    layers = pair_blocks(kinds)
    n = len(layers)
    eps = float(cfg.get("layer_norm_epsilon", cfg.get("rms_norm_eps", 1e-5)))
    dt_min, dt_max = _time_step_limit(cfg)
    try:
        mamba = Mamba2Config(num_heads=require(cfg, "mamba_num_heads"), head_dim=require(cfg, "mamba_head_dim"),
                             num_groups=int(cfg.get("n_groups") or 1), state_size=require(cfg, "ssm_state_size"),
                             conv_kernel=require(cfg, "conv_kernel"), eps=eps,
                             conv_bias=bool(cfg.get("use_conv_bias", True)), proj_bias=bool(cfg.get("use_bias", False)),
                             dt_min=dt_min, dt_max=dt_max)
    except ValueError as exc:
        raise ModelFormatError(f"config.json: {exc}") from exc
    ffn_kinds = [kinds[f] if f is not None else None for _, f in layers]
    moe_layers = tuple(k == "moe" for k in ffn_kinds)
    moe = MoeConfig(num_experts=expert_count(cfg) if any(moe_layers) else 1,
                    top_k=int(cfg.get("num_experts_per_tok") or 1),
                    intermediate_size=int(cfg.get("moe_intermediate_size") or 0) or 1, scoring="sigmoid",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                    num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
                    has_score_correction_bias=True, activation="relu2",
                    shared_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size") or 0)
                    if int(cfg.get("n_shared_experts") or 0) else 0)
    if any(moe_layers) and moe.num_experts % moe.num_groups:
        raise ModelFormatError(f"config.json: {moe.num_experts} experts are not divisible by n_group={moe.num_groups}")
    att = mha(cfg)  # no biases, no q/k norm, no rotary
    base = base_config(dict(cfg, num_hidden_layers=n, rms_norm_eps=eps), att, moe, moe_layers, (None,) * n,
                       att.head_dim, dense_intermediate=int(cfg.get("intermediate_size") or 0) or 1)
    return dataclasses.replace(
        base, linear_attention=mamba, linear_layers=tuple(kinds[m] == "linear_attention" for m, _ in layers),
        nope_layers=(True,) * n, mlp_layers=tuple(f is not None for _, f in layers), mlp_activation="relu2",
        tensor_renames=_renames(kinds, layers))


FAMILIES = (
    Family("nemotron_h", _parse_nemotron_h, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", score_bias="gate.e_score_correction_bias",
        shared="shared_experts", expert_gate="", expert_up="experts.{e}.up_proj.weight",
        expert_down="experts.{e}.down_proj.weight", skip_prefixes=("mtp.",)),
        architectures=("NemotronHForCausalLM",), tool_format="qwen3"),
)
