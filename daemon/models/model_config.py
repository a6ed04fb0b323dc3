"""ModelConfig: the one frozen description of a model's architecture, parsed from config.json.

Its per-layer parts (``AttentionConfig``, ``RopeConfig``, ``MoeConfig``) live in
``moed.layers.layer_config``: models import layers, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moed.errors import ModelFormatError
from moed.layers.gated_deltanet import DeltaNetConfig
from moed.layers.mamba2 import Mamba2Config
from moed.layers.hyper_connections import HyperConnectionConfig
from moed.layers.layer_config import AttentionConfig, MoeConfig, RopeConfig


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
    # hybrid models: which layers mix tokens with a recurrent layer instead of attention (Qwen3-Next's gated
    # DeltaNet, Nemotron-H's Mamba-2)
    linear_attention: DeltaNetConfig | Mamba2Config | None = None
    linear_layers: tuple[bool, ...] = ()
    # per layer, whether it has a feed-forward part (empty: every layer); Nemotron-H pairs each mixer block with
    # the feed-forward block after it, and a mixer followed by another mixer has none
    mlp_layers: tuple[bool, ...] = ()
    # silu: SwiGLU MLPs; relu2: Nemotron-H's non-gated down(relu(up(x))^2) dense MLPs and shared experts (routed
    # experts: MoeConfig.activation)
    mlp_activation: str = "silu"
    # Gemma-4: the attention and rotary of its full-attention layers (sliding_windows[i] None) when they differ from
    # the sliding layers' (``attention`` / ``rope``); the embedding scaled by sqrt(hidden_size) (in the table's
    # dtype); the final logits soft-capped (tanh(l / c) * c, 0: none); its layer recipe ("gemma4": sandwich norms,
    # a dense MLP beside the experts, a per-layer output scale: layers/gemma_feed_forward.py)
    full_attention: AttentionConfig | None = None
    full_rope: RopeConfig | None = None
    scale_embedding: bool = False
    final_logit_softcapping: float = 0.0
    layer_recipe: str = "pre_norm"
    # (regex, replacement) pairs the config implies, applied after the family's own renames to every tensor name
    # of a checkpoint (Nemotron-H: its blocks -> moed's layers)
    tensor_renames: tuple[tuple[str, str], ...] = ()
    norm_offset: float = 0.0  # Qwen3-Next's RMSNorms scale by (offset + w)
    # sparse attention (attention.index_topk > 0): per layer, whether it runs its own indexer (True) or reuses
    # the top-k keys of the nearest indexer layer before it (GLM-5's "shared" layers); empty: every layer runs one
    indexer_layers: tuple[bool, ...] = ()
    # Llama-4: per layer, the chunk of its chunked local attention (a query sees the keys of its own chunk of
    # that many positions; None: every earlier key), and which layers use no rotary embedding (NoPE)
    attention_chunks: tuple[int | None, ...] = ()
    nope_layers: tuple[bool, ...] = ()
    # DeepSeek-V4: per layer, the compression ratio of its KV (0: sliding window only; the CSA ratio: compressed
    # sparse attention with an indexer; the HCA ratio: heavily compressed), which layers route by token id
    # (tid2eid), the hyper-connection residual, and the compressed branches' own rotary
    compress_ratios: tuple[int, ...] = ()
    csa_ratio: int = 0
    hash_layers: tuple[bool, ...] = ()
    hyper: HyperConnectionConfig | None = None
    compress_rope: RopeConfig | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def has_indexer(self, layer: int) -> bool:
        """Whether ``layer`` runs its own lightning indexer (sparse attention only)."""
        return bool(self.attention.index_topk) and (not self.indexer_layers or self.indexer_layers[layer])

    def index_source(self, layer: int) -> int:
        """The layer whose indexer picks ``layer``'s keys (itself, or the nearest indexer layer before it)."""
        source = layer
        while not self.has_indexer(source):
            source -= 1
        return source

    def attention_chunk(self, layer: int) -> int | None:
        return self.attention_chunks[layer] if self.attention_chunks else None

    def uses_rope(self, layer: int) -> bool:
        return not (self.nope_layers and self.nope_layers[layer])

    def layer_attention(self, layer: int) -> AttentionConfig:
        """The attention of ``layer`` (Gemma-4's full layers have their own head size and KV heads)."""
        if self.full_attention is not None and self.sliding_windows[layer] is None:
            return self.full_attention
        return self.attention

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.full_rope is not None and self.sliding_windows[layer] is None:
            return self.full_rope
        return self.rope

    def has_mlp(self, layer: int) -> bool:
        return not self.mlp_layers or self.mlp_layers[layer]

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def has_recurrent_state(self) -> bool:
        """Some layers carry a per-sequence state besides the KV cache (K/V alone cannot resume them)."""
        return any(self.linear_layers)

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
    if rope_type not in ("default", "linear", "llama3", "yarn", "factors", "proportional"):
        raise ModelFormatError(
            f"config.json: rope type {rope_type!r} is not supported (supported: default, linear, llama3, yarn)"
        )
    if rope_type == "factors":  # a GGUF's rope_freqs (llama.cpp's form of llama3 scaling): one divisor a frequency
        factors = params.get("freq_factors")
        if not isinstance(factors, (list, tuple)) or not all(isinstance(f, (int, float)) and f > 0 for f in factors):
            raise ModelFormatError("config.json: rope type 'factors' needs freq_factors, positive numbers")
        params["freq_factors"] = tuple(float(f) for f in factors)
    partial = params.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if rope_type == "proportional":  # the whole head takes part; the fraction chooses the rotated pairs
        params["partial_rotary_factor"], partial = float(partial), 1.0
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        dim=int(dim * partial),
        interleaved=interleaved,
        params=tuple(sorted(params.items())),
    )
