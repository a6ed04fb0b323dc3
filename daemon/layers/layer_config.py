"""The frozen configs the layers are built from: attention, rotary embedding, MoE routing.

They are parts of ``moed.models.model_config.ModelConfig`` (parsed from config.json by
``moed.models.families``) and live here so that ``layers/`` never imports ``models/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' ``rope_parameters``)."""

    # default | linear | llama3 | yarn | factors (a GGUF's rope_freqs divisors) | proportional (Gemma-4's full layers:
    # ``dim`` is the whole head, its first partial_rotary_factor * dim / 2 pairs rotate at theta^(-2j/dim), the rest
    # not at all)
    rope_type: str = "default"
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
    scoring: str = "softmax"  # softmax | sigmoid | topk_softmax (gpt-oss: softmax over the top-k logits) | sqrtsoftplus
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1  # DeepSeek group-limited routing
    topk_groups: int = 1
    has_score_correction_bias: bool = False
    has_router_bias: bool = False
    shared_intermediate_size: int = 0  # 0 = no shared expert
    has_shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(D, 1)) scales the shared expert
    # silu | gpt_oss | clamped_silu (DeepSeek-V4: gate <= limit, |up| <= limit) | relu2 (Nemotron-H's non-gated
    # relu(up)^2 experts: the bank holds their up matrix in the gate half too, and computes max(gate, 0) * up)
    activation: str = "silu"
    has_expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Llama-4: the chosen expert's router weight scales its INPUT (expert(w * x), weight 1), not its output; exact
    # for one expert per token only (the shared expert takes x unscaled)
    weight_input: bool = False
    # Gemma-4: the router's input is multiplied by this (hidden_size^-0.5) and by a per-channel scale tensor
    router_input_scale: float = 1.0


@dataclass(frozen=True)
class AttentionConfig:
    """Attention of every layer (per-layer differences live in ModelConfig.sliding_windows)."""

    kind: str  # mha (includes GQA/MQA) | mla
    num_heads: int
    num_kv_heads: int
    head_dim: int
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    # none | per_head (Qwen3) | full (OLMoE: over the whole projection) | weightless (Llama-4: a per-head RMS norm
    # without weights, on the rotary layers only; it commutes with the rotation, so it runs where per_head does)
    qk_norm: str = "none"
    clip_qkv: float | None = None
    has_sinks: bool = False
    gated: bool = False  # Qwen3-Next: q_proj also gives a per-channel gate, sigmoid(gate) * attention output
    scaling: float = 0.0
    # Gemma-4's full-attention layers: no v_proj, the values are the key projection (before its norm and rotary)
    k_eq_v: bool = False
    v_norm: bool = False  # Gemma-4: a weightless per-head RMS norm of the values
    # Llama-4's no-rotary layers scale each query by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1:
    # (floor_scale, attn_scale), or () for none
    nope_temperature: tuple[float, float] = ()
    # MLA (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    latent_norm_eps: float = 0.0  # kv_a_layernorm's eps when it is not the model's (Kimi-Linear: 1e-6)
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks each query's top
    # ``index_topk`` keys (0: every key, no indexer)
    index_topk: int = 0
    index_num_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleaved: bool = False  # GLM-5 rotates the indexer's pairs (x0, x1)...; V3.2 its halves
    # DeepSeek-V4 ("compressed" attention): one shared K=V head of head_dim, the heads' outputs projected by
    # o_groups groups to o_lora_rank each, then mixed to the hidden size
    o_groups: int = 0
    o_lora_rank: int = 0
