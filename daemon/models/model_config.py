"""ModelConfig: the one frozen description of a model's architecture, parsed from config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moed.errors import ModelFormatError


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' ``rope_parameters``)."""

    rope_type: str = "default"  # default | linear | llama3 | yarn
    theta: float = 10000.0
    dim: int = 0  # rotated dims per head
    interleaved: bool = False  # DeepSeek lays rotary pairs out as (x0, x1), (x2, x3)...
    params: tuple[tuple[str, Any], ...] = ()  # the remaining rope_parameters, sorted

    def param(self, name: str, default: Any = None) -> Any:
        for key, value in self.params:
            if key == name:
                return value
        return default


@dataclass(frozen=True)
class MoeConfig:
    """Routing of one MoE layer kind."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"  # softmax | sigmoid | topk_softmax (gpt-oss: softmax over the top-k logits)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1  # DeepSeek group-limited routing
    topk_groups: int = 1
    has_score_correction_bias: bool = False
    has_router_bias: bool = False
    shared_intermediate_size: int = 0  # 0 = no shared expert
    has_shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(D, 1)) scales the shared expert
    activation: str = "silu"  # silu | gpt_oss
    has_expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class AttentionConfig:
    """Attention of every layer (per-layer differences live in ModelConfig.sliding_windows)."""

    kind: str  # mha (includes GQA/MQA) | mla
    num_heads: int
    num_kv_heads: int
    head_dim: int
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    qk_norm: str = "none"  # none | per_head (Qwen3) | full (OLMoE: over the whole projection)
    clip_qkv: float | None = None
    has_sinks: bool = False
    scaling: float = 0.0
    # MLA (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to build and run one checkpoint."""

    family: str  # the config.json model_type
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention: AttentionConfig
    rope: RopeConfig
    moe: MoeConfig
    dense_intermediate_size: int  # MLP size of the non-MoE layers
    moe_layers: tuple[bool, ...]  # per layer: True = MoE, False = dense MLP
    sliding_windows: tuple[int | None, ...]  # per layer: None = full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    def moe_layer_index(self, layer: int) -> int:
        """Ordinal of ``layer`` among MoE layers (its row block in the expert bank)."""
        if not self.moe_layers[layer]:
            raise ValueError(f"layer {layer} is not an MoE layer")
        return sum(self.moe_layers[:layer])


def require(cfg: dict, key: str, kind: type | tuple[type, ...] = int, *, where: str = "config.json") -> Any:
    """Read a required field, with an error that names it."""
    if key not in cfg or cfg[key] is None:
        raise ModelFormatError(f"{where}: required field {key!r} is missing")
    value = cfg[key]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ModelFormatError(f"{where}: field {key!r} should be {_type_name(kind)}, got {value!r}")
    if kind is int and value <= 0:
        raise ModelFormatError(f"{where}: field {key!r} must be positive, got {value!r}")
    return value


def _type_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def eos_ids(cfg: dict) -> tuple[int, ...]:
    value = cfg.get("eos_token_id")
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_from_config(cfg: dict, dim: int, *, interleaved: bool = False) -> RopeConfig:
    """Accept both the transformers-5 ``rope_parameters`` and the older ``rope_scaling``/``rope_theta``."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", "default") or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ModelFormatError(
            f"config.json: rope type {rope_type!r} is not supported (supported: default, linear, llama3, yarn)"
        )
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        dim=int(dim * partial),
        interleaved=interleaved,
        params=tuple(sorted(params.items())),
    )
