"""The supported model families: how each one's config.json and checkpoint names map onto moed's model.

Every family shares one decoder-layer shape (norm, attention, norm, MLP-or-MoE); what differs
is parsed here into a ``ModelConfig`` and a ``FamilyNames`` table. Canonical tensor names
(used inside moed and in FTW files) are the Hugging Face ones for embeddings, norms and
attention; MoE parts are renamed to ``model.layers.{i}.mlp.router.*``, ``...mlp.shared.*``
so the runtime needs no per-family branches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from moed.errors import ModelFormatError, UnsupportedModelError
from moed.layers.gated_deltanet import DeltaNetConfig
from moed.layers.layer_config import AttentionConfig, MoeConfig
from moed.models.model_config import ModelConfig, eos_ids, require, rope_from_config


@dataclass(frozen=True)
class FamilyNames:
    """Checkpoint tensor names of the MLP part of layer ``{i}`` (``{e}`` = expert)."""

    moe_prefix: str  # e.g. "model.layers.{i}.mlp"
    router: str  # relative to moe_prefix, without ".weight"
    expert_gate: str = "experts.{e}.gate_proj.weight"  # per-expert layout; "" when fused
    expert_up: str = "experts.{e}.up_proj.weight"
    expert_down: str = "experts.{e}.down_proj.weight"
    fused_gate_up: str = ""  # gpt-oss: [E, D, 2I] interleaved gate/up columns
    fused_down: str = ""  # gpt-oss: [E, I, D]
    router_bias: str = ""
    score_bias: str = ""  # DeepSeek e_score_correction_bias
    shared: str = ""  # shared expert module
    shared_gate: str = ""  # Qwen2-MoE sigmoid gate
    # a multimodal checkpoint's language model: its tensors' prefix (read as "model."), and the
    # prefixes of the tensors moed does not use (a vision tower, multi-token prediction)
    language_prefix: str = ""
    skip_prefixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    name: str
    parse: Callable[[dict], ModelConfig]
    names: FamilyNames


def _base(cfg: dict, attention: AttentionConfig, moe: MoeConfig, moe_layers: tuple[bool, ...],
          windows: tuple[int | None, ...], rope_dim: int, *, interleaved: bool = False,
          dense_intermediate: int | None = None) -> ModelConfig:
    num_layers = require(cfg, "num_hidden_layers")
    return ModelConfig(
        family=cfg["model_type"],
        vocab_size=require(cfg, "vocab_size"),
        hidden_size=require(cfg, "hidden_size"),
        num_layers=num_layers,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention=attention,
        rope=rope_from_config(cfg, rope_dim, interleaved=interleaved),
        moe=moe,
        dense_intermediate_size=int(dense_intermediate or cfg.get("intermediate_size") or 0),
        moe_layers=moe_layers,
        sliding_windows=windows,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
        raw=cfg,
    )


def _mha(cfg: dict, **kw) -> AttentionConfig:
    heads = require(cfg, "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or require(cfg, "hidden_size") // heads)
    if heads % kv_heads:
        raise ModelFormatError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    return AttentionConfig(kind="mha", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           scaling=head_dim ** -0.5, **kw)


def _windows(cfg: dict, num_layers: int, *, all_layers_default: bool) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window") or None
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ModelFormatError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in types)
    use = cfg.get("use_sliding_window", all_layers_default)
    return tuple(window if (use and window) else None for _ in range(num_layers))


def _num_experts(cfg: dict) -> int:
    """Hub configs say num_experts / n_routed_experts; transformers 5 may save num_local_experts."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key):
            return require(cfg, key)
    raise ModelFormatError("config.json: required field 'num_experts' (or num_local_experts) is missing")


def _check_act(cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelFormatError(f"config.json: hidden_act {act!r} is not supported (moed runs SwiGLU experts: silu)")


def _parse_mixtral(cfg: dict) -> ModelConfig:
    _check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = _mha(cfg)
    moe = MoeConfig(num_experts=_num_experts(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "intermediate_size"), scoring="softmax", norm_topk_prob=True)
    return _base(cfg, att, moe, (True,) * n, _windows(cfg, n, all_layers_default=True), att.head_dim)


def _qwen_moe_layers(cfg: dict, n: int) -> tuple[bool, ...]:
    only_dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return tuple(i not in only_dense and (i + 1) % step == 0 for i in range(n))


def _parse_qwen2_moe(cfg: dict) -> ModelConfig:
    _check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = _mha(cfg, has_qkv_bias=bool(cfg.get("qkv_bias", True)))
    moe = MoeConfig(num_experts=_num_experts(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "moe_intermediate_size"), scoring="softmax",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                    shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                    has_shared_expert_gate=True)
    return _base(cfg, att, moe, _qwen_moe_layers(cfg, n), _windows(cfg, n, all_layers_default=False), att.head_dim)


def _parse_qwen3_moe(cfg: dict) -> ModelConfig:
    _check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = _mha(cfg, has_qkv_bias=bool(cfg.get("attention_bias", False)),
               has_o_bias=bool(cfg.get("attention_bias", False)), qk_norm="per_head")
    moe = MoeConfig(num_experts=_num_experts(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "moe_intermediate_size"), scoring="softmax",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    return _base(cfg, att, moe, _qwen_moe_layers(cfg, n), _windows(cfg, n, all_layers_default=False), att.head_dim)


def _parse_olmoe(cfg: dict) -> ModelConfig:
    _check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = _mha(cfg, has_qkv_bias=bool(cfg.get("attention_bias", False)),
               has_o_bias=bool(cfg.get("attention_bias", False)), qk_norm="full", clip_qkv=cfg.get("clip_qkv"))
    moe = MoeConfig(num_experts=_num_experts(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "intermediate_size"), scoring="softmax",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return _base(cfg, att, moe, (True,) * n, (None,) * n, att.head_dim)


def _parse_deepseek_v3(cfg: dict) -> ModelConfig:
    _check_act(cfg)
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
            import math
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scaling = scaling * mscale * mscale
    att = AttentionConfig(
        kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=qk_head_dim,
        has_qkv_bias=bool(cfg.get("attention_bias", False)), has_o_bias=bool(cfg.get("attention_bias", False)),
        scaling=scaling, q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=require(cfg, "kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=require(cfg, "v_head_dim"),
    )
    moe, moe_layers = _sigmoid_group_moe(cfg, n)
    return _base(cfg, att, moe, moe_layers, (None,) * n, rope_dim,
                 interleaved=bool(cfg.get("rope_interleave", True)))


def _parse_deepseek_v32(cfg: dict) -> ModelConfig:
    """DeepSeek-V3.2: DeepSeek-V3's MLA (always with a q LoRA) and experts, plus DeepSeek Sparse Attention: a
    lightning indexer per layer picks each query's ``index_topk`` keys (its rotary on halves)."""
    return _sparse_mla(cfg, rope_interleaved=False, indexer_layers=())


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
    return _sparse_mla(cfg, rope_interleaved=True, indexer_layers=tuple(t == "full" for t in types))


def _sparse_mla(cfg: dict, *, rope_interleaved: bool, indexer_layers: tuple[bool, ...]) -> ModelConfig:
    for key in ("q_lora_rank", "index_topk", "index_n_heads", "index_head_dim"):
        require(cfg, key)
    rope_dim = require(cfg, "qk_rope_head_dim")
    if cfg["index_head_dim"] < rope_dim:
        raise ModelFormatError(f"config.json: index_head_dim={cfg['index_head_dim']} is smaller than "
                               f"qk_rope_head_dim={rope_dim} (the indexer rotates that many dims of each head)")
    # the MLA attention always rotates pairs (its rope_interleave field is gone from these configs)
    base = _parse_deepseek_v3(dict(cfg, rope_interleave=True))
    n = base.num_layers
    types = cfg.get("mlp_layer_types")
    moe_layers = base.moe_layers
    if types is not None:
        if not isinstance(types, list) or len(types) != n or any(t not in ("dense", "sparse") for t in types):
            raise ModelFormatError(f"config.json: mlp_layer_types must give dense or sparse for each of the {n} layers")
        moe_layers = tuple(t == "sparse" for t in types)
    attention = dataclasses.replace(base.attention, index_topk=cfg["index_topk"], index_num_heads=cfg["index_n_heads"],
                                    index_head_dim=cfg["index_head_dim"], index_rope_interleaved=rope_interleaved)
    return dataclasses.replace(base, attention=attention, moe_layers=moe_layers, indexer_layers=indexer_layers)


def _sigmoid_group_moe(cfg: dict, n: int) -> tuple[MoeConfig, tuple[bool, ...]]:
    """DeepSeek-V3 / GLM-4-MoE experts: sigmoid scores with a correction bias, group-limited top-k,
    routed scaling, shared experts; the first ``first_k_dense_replace`` layers dense."""
    num_experts = _num_experts(cfg)
    groups = int(cfg.get("n_group") or 1)
    if num_experts % groups:
        raise ModelFormatError(f"config.json: n_routed_experts={num_experts} is not divisible by n_group={groups}")
    moe = MoeConfig(num_experts=num_experts, top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "moe_intermediate_size"), scoring="sigmoid",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                    num_groups=groups, topk_groups=int(cfg.get("topk_group") or 1),
                    has_score_correction_bias=True,
                    shared_intermediate_size=int(cfg.get("n_shared_experts") or 0) * require(cfg, "moe_intermediate_size"))
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return moe, tuple(i >= first_dense for i in range(n))


def _parse_glm4_moe(cfg: dict) -> ModelConfig:
    """GLM-4.5 / 4.6 / 4.7 (Air): GQA attention with q/k/v biases, optional per-head q/k norms and partial
    rotary (rotate-half on the first half of each head), DeepSeek-V3's experts."""
    _check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    att = _mha(cfg, has_qkv_bias=bool(cfg.get("attention_bias", False)),
               qk_norm="per_head" if cfg.get("use_qk_norm") else "none")
    moe, moe_layers = _sigmoid_group_moe(cfg, n)
    return _base(cfg, att, moe, moe_layers, (None,) * n, att.head_dim)


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
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError("config.json: a qwen3_5_moe checkpoint needs its language model's text_config")
    merged = dict(text, model_type=cfg["model_type"])
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key not in merged and key in cfg:
            merged[key] = cfg[key]
    return _parse_qwen3_5_moe_text(merged)


def _parse_qwen3_next(cfg: dict) -> ModelConfig:
    """Qwen3-Next: gated DeltaNet layers (``layer_types`` "linear_attention") between gated full-attention
    layers (per-head (1 + w) q/k norms, partial rotary); Qwen2-MoE-style experts with a sigmoid-gated
    shared expert; every RMSNorm but the DeltaNet's output norm scales by (1 + w)."""
    _check_act(cfg)
    n = require(cfg, "num_hidden_layers")
    types = cfg.get("layer_types") or []
    if len(types) != n or any(t not in ("linear_attention", "full_attention") for t in types):
        raise ModelFormatError(f"config.json: layer_types must give linear_attention or full_attention for each of "
                               f"the {n} layers")
    bias = bool(cfg.get("attention_bias", False))
    att = _mha(cfg, has_qkv_bias=bias, has_o_bias=bias, qk_norm="per_head", gated=True)
    try:
        linear = DeltaNetConfig(num_k_heads=require(cfg, "linear_num_key_heads"),
                                num_v_heads=require(cfg, "linear_num_value_heads"),
                                k_head_dim=require(cfg, "linear_key_head_dim"),
                                v_head_dim=require(cfg, "linear_value_head_dim"),
                                conv_kernel=require(cfg, "linear_conv_kernel_dim"),
                                eps=float(cfg.get("rms_norm_eps", 1e-6)))
    except ValueError as exc:
        raise ModelFormatError(f"config.json: {exc}") from exc
    moe = MoeConfig(num_experts=_num_experts(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "moe_intermediate_size"), scoring="softmax",
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                    shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                    has_shared_expert_gate=True)
    base = _base(cfg, att, moe, _qwen_moe_layers(cfg, n), (None,) * n, att.head_dim)
    return dataclasses.replace(base, linear_attention=linear,
                               linear_layers=tuple(t == "linear_attention" for t in types), norm_offset=1.0)


def _parse_gpt_oss(cfg: dict) -> ModelConfig:
    n = require(cfg, "num_hidden_layers")
    att = _mha(cfg, has_qkv_bias=True, has_o_bias=True, has_sinks=True)
    moe = MoeConfig(num_experts=_num_experts(cfg), top_k=require(cfg, "num_experts_per_tok"),
                    intermediate_size=require(cfg, "intermediate_size"), scoring="topk_softmax",
                    has_router_bias=True, activation="gpt_oss", has_expert_bias=True,
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    return _base(cfg, att, moe, (True,) * n, _windows(cfg, n, all_layers_default=False), att.head_dim)


FAMILIES: dict[str, Family] = {
    "mixtral": Family("mixtral", _parse_mixtral, FamilyNames(
        moe_prefix="model.layers.{i}.block_sparse_moe", router="gate",
        expert_gate="experts.{e}.w1.weight", expert_up="experts.{e}.w3.weight", expert_down="experts.{e}.w2.weight")),
    "qwen2_moe": Family("qwen2_moe", _parse_qwen2_moe, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", shared="shared_expert", shared_gate="shared_expert_gate")),
    "qwen3_moe": Family("qwen3_moe", _parse_qwen3_moe, FamilyNames(moe_prefix="model.layers.{i}.mlp", router="gate")),
    "olmoe": Family("olmoe", _parse_olmoe, FamilyNames(moe_prefix="model.layers.{i}.mlp", router="gate")),
    "deepseek_v3": Family("deepseek_v3", _parse_deepseek_v3, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", score_bias="gate.e_score_correction_bias",
        shared="shared_experts")),
    "deepseek_v32": Family("deepseek_v32", _parse_deepseek_v32, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", score_bias="gate.e_score_correction_bias",
        shared="shared_experts")),
    "glm_moe_dsa": Family("glm_moe_dsa", _parse_glm_moe_dsa, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", score_bias="gate.e_score_correction_bias",
        shared="shared_experts")),
    "glm4_moe": Family("glm4_moe", _parse_glm4_moe, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", score_bias="gate.e_score_correction_bias",
        shared="shared_experts")),
    "qwen3_next": Family("qwen3_next", _parse_qwen3_next, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", shared="shared_expert", shared_gate="shared_expert_gate")),
    "qwen3_5_moe_text": Family("qwen3_5_moe_text", _parse_qwen3_5_moe_text, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="gate", shared="shared_expert", shared_gate="shared_expert_gate")),
    "qwen3_5_moe": Family("qwen3_5_moe", _parse_qwen3_5_moe, FamilyNames(
        moe_prefix="model.language_model.layers.{i}.mlp", router="gate", shared="shared_expert",
        shared_gate="shared_expert_gate", language_prefix="model.language_model.",
        skip_prefixes=("model.visual.", "mtp."))),
    "gpt_oss": Family("gpt_oss", _parse_gpt_oss, FamilyNames(
        moe_prefix="model.layers.{i}.mlp", router="router", router_bias="router.bias",
        expert_gate="", expert_up="", expert_down="",
        fused_gate_up="experts.gate_up_proj", fused_down="experts.down_proj")),
}

ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}


def family_of(cfg: dict, *, where: str = "config.json") -> Family:
    """Pick the family from ``model_type`` (or ``architectures``), or say which ones exist."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        for arch in cfg.get("architectures") or []:
            if arch in ARCHITECTURES:
                model_type = ARCHITECTURES[arch]
                break
    if model_type not in FAMILIES:
        shown = model_type or (cfg.get("architectures") or ["<none>"])[0]
        raise UnsupportedModelError(
            f"{where}: architecture {shown!r} is not supported. Supported: "
            + ", ".join(f"{arch} ({mt})" for arch, mt in ARCHITECTURES.items())
        )
    return FAMILIES[model_type]


def parse_model_config(cfg: dict, *, where: str = "config.json") -> ModelConfig:
    family = family_of(cfg, where=where)
    cfg = dict(cfg, model_type=family.name)
    try:
        return family.parse(cfg)
    except ModelFormatError as exc:
        if where != "config.json":
            raise ModelFormatError(str(exc).replace("config.json", where, 1)) from None
        raise
