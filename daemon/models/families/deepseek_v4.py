"""DeepSeek-V4 (V4-Flash, V4-Pro): shared-KV attention over a sliding window plus compressed KV (compressed sparse
attention with a lightning indexer, or heavily compressed attention), attention sinks, a grouped output
projection, the hyper-connection residual, sqrt-softplus routing with the first layers routed by token id, and
clamped SwiGLU experts (issue #33).

The config is transformers 5.25's ``DeepseekV4Config`` (its legacy keys too: ``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``); the checkpoint names are DeepSeek's own (``attn.wq_a``, ``ffn.experts.{e}.w1``,
``hc_attn_fn`` ...; what transformers saves), also without its ``model.`` prefix as the published checkpoints
name them (``embed.weight``, ``layers.{i}.…``, ``hc_head_fn``), with their FP8 linears' E8M0 block scales and FP4
experts (``expert_dtype: "fp4"``, weights/hf_checkpoint.py). The model: models/deepseek_v4.py.
"""

from __future__ import annotations

import dataclasses

from moed.errors import ModelFormatError
from moed.layers.hyper_connections import HyperConnectionConfig
from moed.layers.layer_config import AttentionConfig, MoeConfig
from moed.models.families.base import Family, FamilyNames, base_config, check_act, expert_count
from moed.models.model_config import ModelConfig, require, rope_from_config

LAYER_TYPES = {"sliding_attention": "", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _layer_types(cfg: dict, n: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
        ratios = cfg["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in by_ratio for r in ratios):
            raise ModelFormatError(f"config.json: compress_ratios must list 0, 4 or 128 per layer, got {ratios!r}")
        types = [by_ratio[r] for r in ratios]
    if types is None:  # transformers' default: two HCA layers, then CSA and HCA alternating
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    types = list(types[:n])
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ModelFormatError(f"config.json: layer_types must give one of {', '.join(LAYER_TYPES)} for each of the "
                               f"{n} layers")
    return types


def _hash_layers(cfg: dict, n: int) -> tuple[bool, ...]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        hashed = int(cfg.get("num_hash_layers", 3) or 0)
        return tuple(i < hashed for i in range(n))
    if not isinstance(types, list) or len(types) < n or any(t not in ("hash_moe", "moe") for t in types[:n]):
        raise ModelFormatError(f"config.json: mlp_layer_types must give hash_moe or moe for each of the {n} layers")
    return tuple(t == "hash_moe" for t in types[:n])


def _ropes(cfg: dict, rope_dim: int):
    """The sliding layers' rotary ("main") and the compressed branches' ("compress": compress_rope_theta, YaRN
    when the config scales, with attention factor 1 as the reference)."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, comp = dict(params["main"]), dict(params["compress"])
    else:
        scaling = {k: v for k, v in {**(cfg.get("rope_scaling") or {}), **params}.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        comp = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
        comp.setdefault("rope_type", scaling.get("type", "default"))
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
    for p in (main, comp):
        p.pop("partial_rotary_factor", None)
        p.pop("type", None)
    main_rope = rope_from_config({"rope_parameters": main}, rope_dim, interleaved=True)
    comp_rope = rope_from_config({"rope_parameters": comp, "max_position_embeddings": cfg.get("max_position_embeddings")},
                                 rope_dim, interleaved=True)
    return main_rope, comp_rope


def _parse_deepseek_v4(cfg: dict) -> ModelConfig:
    check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    heads, head_dim = require(cfg, "num_attention_heads"), require(cfg, "head_dim")
    for key in ("q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
                "sliding_window", "hc_mult"):
        require(cfg, key)
    if heads % cfg["o_groups"]:
        raise ModelFormatError(f"config.json: num_attention_heads={heads} is not divisible by o_groups={cfg['o_groups']}")
    partial = cfg.get("partial_rotary_factor")
    rope_dim = int(cfg.get("qk_rope_head_dim") or (head_dim * partial if partial else 64))
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim or rope_dim > cfg["index_head_dim"]:
        raise ModelFormatError(f"config.json: the rotary dims ({rope_dim}) must be even and at most head_dim "
                               f"({head_dim}) and index_head_dim ({cfg['index_head_dim']})")
    types = _layer_types(cfg, n)
    rates = {**DEFAULT_RATES, **(cfg.get("compress_rates") or {})}
    for key in ("compress_rate_csa", "compress_rate_hca"):  # legacy scalar keys
        if cfg.get(key):
            rates["compressed_sparse_attention" if key.endswith("csa") else "heavily_compressed_attention"] = cfg[key]
    ratios = tuple(0 if t == "sliding_attention" else int(rates[t]) for t in types)
    for t in set(types) - {"sliding_attention"}:  # an entry is sliced over its window's slots (docs/design.md)
        r = int(rates[t])
        dims = (head_dim, cfg["index_head_dim"]) if t == "compressed_sparse_attention" else (head_dim,)
        if r <= 0 or any(d % r for d in dims):
            raise ModelFormatError(f"config.json: the {t} compression rate {r} must divide "
                                   + " and ".join(str(d) for d in dims))
    att = AttentionConfig(kind="compressed", num_heads=heads, num_kv_heads=1, head_dim=head_dim, has_sinks=True,
                          scaling=head_dim ** -0.5, q_lora_rank=cfg["q_lora_rank"], qk_rope_head_dim=rope_dim,
                          index_topk=cfg["index_topk"], index_num_heads=cfg["index_n_heads"],
                          index_head_dim=cfg["index_head_dim"], index_rope_interleaved=True,
                          o_groups=cfg["o_groups"], o_lora_rank=cfg["o_lora_rank"])
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "softmax", "sigmoid"):
        raise ModelFormatError(f"config.json: scoring_func {scoring!r} is not one of sqrtsoftplus, softmax, sigmoid")
    inter = require(cfg, "moe_intermediate_size")
    moe = MoeConfig(num_experts=expert_count(cfg), top_k=require(cfg, "num_experts_per_tok"), intermediate_size=inter,
                    scoring=scoring, norm_topk_prob=True,
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                    has_score_correction_bias=True,
                    shared_intermediate_size=int(cfg.get("n_shared_experts", 1) or 0) * inter,
                    activation="clamped_silu", swiglu_limit=float(cfg.get("swiglu_limit", 10.0)))
    main_rope, comp_rope = _ropes(cfg, rope_dim)
    base = base_config(cfg, att, moe, (True,) * n, (int(cfg["sliding_window"]),) * n, rope_dim, interleaved=True)
    hyper = HyperConnectionConfig(streams=int(cfg["hc_mult"]), sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
                                  eps=float(cfg.get("hc_eps", 1e-6)), norm_eps=base.rms_norm_eps)
    return dataclasses.replace(base, rope=main_rope, compress_ratios=ratios,
                               csa_ratio=int(rates["compressed_sparse_attention"]),
                               hash_layers=_hash_layers(cfg, n), hyper=hyper, compress_rope=comp_rope,
                               indexer_layers=tuple(t == "compressed_sparse_attention" for t in types))


# the published checkpoints (deepseek-ai/DeepSeek-V4-Flash ...) name their tensors without transformers' "model."
# prefix and name the head's parts apart; their block scales are "X.scale" (read as "X.weight_scale_inv")
PUBLISHED_NAMES = ((r"^embed\.weight$", "model.embed_tokens.weight"), (r"^norm\.weight$", "model.norm.weight"),
                   (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"), (r"^layers\.", "model.layers."))

DEEPSEEK_V4_NAMES = FamilyNames(moe_prefix="model.layers.{i}.ffn", router="gate", score_bias="gate.bias",
                                router_table="gate.tid2eid", shared="shared_experts",
                                shared_parts=("w1", "w3", "w2"), expert_gate="experts.{e}.w1.weight",
                                expert_up="experts.{e}.w3.weight", expert_down="experts.{e}.w2.weight",
                                lm_head="head.weight", skip_prefixes=("mtp.",), renames=PUBLISHED_NAMES)


FAMILIES = (
    Family("deepseek_v4", _parse_deepseek_v4, DEEPSEEK_V4_NAMES, architectures=("DeepseekV4ForCausalLM",),
           tool_format="dsml", chat_template="deepseek_v4"),
)
