"""What every family module shares: the ``Family`` record, checkpoint names, and config-parsing helpers.

A family module (one per architecture group, e.g. ``glm.py``) parses its config.json into a ``ModelConfig``
and says how its checkpoint names the MoE parts, which architectures name it, which output format its
answers are written in (``moed.text.output_parser.FORMATS``) and, when its checkpoints ship none, which
of moed's chat templates it takes (``moed.text.builtin_templates``). docs/architecture.md has the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moed.errors import ModelFormatError
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
    fused_interleaved: bool = True  # False: fused_gate_up holds the gate columns, then the up ones (Llama-4)
    fused_transposed: bool = False  # True: fused_gate_up is [E, 2I, D] and fused_down [E, D, I] (Gemma-4: nn.Linear rows)
    router_input_scale: str = ""  # Gemma-4: the router's per-channel input scale (relative to moe_prefix)
    router_expert_scale: str = ""  # Gemma-4: each expert's weight scale
    fused_down: str = ""  # gpt-oss: [E, I, D]
    router_bias: str = ""
    score_bias: str = ""  # DeepSeek e_score_correction_bias
    shared: str = ""  # shared expert module
    shared_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # its gate, up, down (DeepSeek-V4: w1, w3, w2)
    shared_gate: str = ""  # Qwen2-MoE sigmoid gate
    router_table: str = ""  # DeepSeek-V4's hash layers: the token id -> experts table (int64 [V, top_k])
    lm_head: str = "lm_head.weight"  # DeepSeek-V4: "head.weight"
    # a multimodal checkpoint's language model: its tensors' prefix (read as "model."), and the
    # prefixes of the tensors moed does not use (a vision tower, multi-token prediction)
    language_prefix: str = ""
    skip_prefixes: tuple[str, ...] = ()
    # (regex, replacement) pairs, applied in order to every tensor name of a checkpoint published under other
    # names than transformers saves (DeepSeek-V4's own layout: "embed.weight", "layers.{i}.…")
    renames: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Family:
    name: str  # config.json model_type
    parse: Callable[[dict], ModelConfig]
    names: FamilyNames
    architectures: tuple[str, ...] = ()  # config.json "architectures" entries that name this family
    tool_format: str = "plain"  # how its answers write tool calls and reasoning (moed.text.output_parser)
    chat_template: str | None = None  # moed's template for checkpoints that ship none (moed.text.builtin_templates)


def language_config(cfg: dict, family: str, *, outer_tie: bool = False) -> dict:
    """A multimodal checkpoint's language model config: its ``text_config`` with the outer ``model_type`` and, where
    the text config lacks them, the outer end / start token ids and tie flag (``outer_tie``: the outer tie flag
    wins, as transformers ties by it)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"config.json: a {family} checkpoint needs its language model's text_config")
    merged = dict(text, model_type=cfg["model_type"])
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in cfg and (key not in merged or (outer_tie and key == "tie_word_embeddings")):
            merged[key] = cfg[key]
    return merged


def base_config(cfg: dict, attention: AttentionConfig, moe: MoeConfig, moe_layers: tuple[bool, ...],
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


def mha(cfg: dict, **kw) -> AttentionConfig:
    heads = require(cfg, "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or require(cfg, "hidden_size") // heads)
    if heads % kv_heads:
        raise ModelFormatError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    return AttentionConfig(kind="mha", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           scaling=head_dim ** -0.5, **kw)


def windows(cfg: dict, num_layers: int, *, all_layers_default: bool) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window") or None
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ModelFormatError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(window if t == "sliding_attention" else None for t in types)
    use = cfg.get("use_sliding_window", all_layers_default)
    return tuple(window if (use and window) else None for _ in range(num_layers))


def expert_count(cfg: dict) -> int:
    """Hub configs say num_experts / n_routed_experts; transformers 5 may save num_local_experts."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(key):
            return require(cfg, key)
    raise ModelFormatError("config.json: required field 'num_experts' (or num_local_experts) is missing")


def check_act(cfg: dict) -> None:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelFormatError(f"config.json: hidden_act {act!r} is not supported (moed runs SwiGLU experts: silu)")


def qwen_moe_layers(cfg: dict, n: int) -> tuple[bool, ...]:
    only_dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return tuple(i not in only_dense and (i + 1) % step == 0 for i in range(n))


def sigmoid_group_moe(cfg: dict, n: int) -> tuple[MoeConfig, tuple[bool, ...]]:
    """DeepSeek-V3 / GLM-4-MoE experts: sigmoid scores with a correction bias, group-limited top-k,
    routed scaling, shared experts; the first ``first_k_dense_replace`` layers dense."""
    num_experts = expert_count(cfg)
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
