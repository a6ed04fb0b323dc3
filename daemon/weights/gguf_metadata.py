"""A GGUF file's metadata read into the config.json a Hugging Face checkpoint of the same model has.

One builder per llama.cpp architecture (``ARCHITECTURES``); each reads the keys llama.cpp's
``convert_hf_to_gguf.py`` writes for it (checked by converting the tiny HF parity models with that
script: tests/weights/test_llamacpp_converter.py) and gives the dict ``parse_model_config`` takes.
What every architecture shares: block_count, embedding_length, attention.head_count(_kv),
attention.key_length, context_length, attention.layer_norm_rms_epsilon, rope.freq_base and
rope.scaling.*, expert_count, expert_used_count.

- qwen3moe -> qwen3_moe: expert_feed_forward_length; q/k norms; ``norm_topk_prob`` is always true
  (llama.cpp's qwen3moe graph normalises the top-k weights and stores no key for it).
- qwen2moe -> qwen2_moe: the shared expert and its sigmoid gate; ``norm_topk_prob`` always false.
  Its graph has an MoE in every layer: a model with dense layers cannot be written and is refused.
- gpt-oss -> gpt_oss: biases, sinks, sliding window (attention.sliding_window_pattern, default 2:
  even layers slide), yarn with ``truncate: false``, the clamped SwiGLU's 1.702 / 7.0.
- olmoe -> olmoe: full-width q/k norms; no clip_qkv (llama.cpp stores none: OLMoE-1B-7B has none).
- llama with experts -> mixtral: Q/K rows permuted by the converter (undone when read, see
  gguf_names.py); a llama file without experts is a dense model and refused.
- deepseek2 -> deepseek_v3 (DeepSeek-V3/R1, Kimi-K2 and the other MLA models llama.cpp writes as
  deepseek2): MLA ranks and the ``*_mla`` head sizes (key_length there is the absorbed
  kv_lora + rope); sigmoid routing (expert_gating_func 2) with group limits, scale and norm; the
  yarn log multiplier is 0.1 * mscale_all_dim. Softmax-routed DeepSeek-V2 files are refused.
- deepseek2 with Moonshot's chat template (``<|im_middle|>``) -> kimi_k2 (Kimi-K2): DeepSeek-V3's model and keys,
  Moonshot's tool-call sections; its "kimi-k2" pre-tokenizer is known to text/gguf_vocab.py.
- deepseek2 with GLM's chat template (``[gMASK]``) -> glm4_moe_lite (GLM-4.7-Flash, which llama.cpp writes as
  deepseek2): the same keys, always sigmoid-routed, MTP layers left out as for glm4moe; GLM's tool-call syntax.
- glm4moe -> glm4_moe: the converter appends the multi-token-prediction layers to block_count
  (``nextn_predict_layers``); they are left out. Partial rotary from rope.dimension_count.
- glm-dsa -> glm_moe_dsa (GLM-5): deepseek2's keys (always sigmoid-routed), MTP layers left out as for
  glm4moe, and the lightning indexer's attention.indexer.{head_count,key_length,top_k,types} (which
  layers run an indexer; without the key, the layers that hold indexer tensors). llama.cpp itself keeps
  the indexer's tensors but runs every key; moed runs the sparse attention they define.
- ernie4_5-moe -> ernie4_5_moe: MoE layers from leading_dense_block_count (moe_layer_start_index) and
  interleave_moe_layer_step (moe_layer_interval) to the last layer, which holds a router; softmax routing
  chosen with exp_probs_b; shared experts (expert_shared_count, each the routed experts' size).
- minimax-m2 -> minimax_m2: full-width q/k norms, partial rotary from rope.dimension_count (rotary_dim),
  sigmoid routing with the correction bias (exp_probs_b; llama.cpp's graph always gates minimax-m2 by
  sigmoid), an MoE in every layer.
- llama4 -> llama4_text (Llama-4 Scout / Maverick): the keys llama.cpp reads and the values its graph fixes
  for them: without ``attention.sliding_window = 0``, three chunked rotary layers (chunks of 8192) then one
  NoPE layer with the query temperature (floor 8192, scale 0.1); the weightless q/k norm unless there are 128
  experts (Maverick); MoE layers every interleave_moe_layer_step (dense ones of feed_forward_length between);
  llama3 rotary scaling as the ``rope_freqs`` tensor of per-frequency divisors (rope type "factors"); Q/K
  not permuted (llama.cpp rotates Llama-4's adjacent pairs, as transformers does).
- nemotron_h_moe -> nemotron_h (Nemotron-3-Nano): no pattern key: a block attends where its
  attention.head_count_kv entry is positive, is an MoE where its feed_forward_length entry is, a Mamba-2
  block where it holds ssm_in, a dense MLP where it holds ffn_up; the Mamba-2 sizes from ssm.* (time_step_rank =
  heads, inner_size = heads x head size, group_count, state_size, conv_kernel); sigmoid routing (llama.cpp's
  graph for this architecture) with expert_weights_norm / _scale and the group counts. Blocks are paired into
  moed's layers as from Hugging Face (``layer_blocks``); every block's norm is its attn_norm.
- gemma4 -> gemma4_text (Gemma-4 26B-A4B): sliding and full layers from attention.sliding_window_pattern, each
  kind's head size (key_length_swa / key_length) and KV heads (the per-layer head_count_kv), the full layers'
  values from their keys where they hold no attn_v, their "proportional" rotary from ``rope_freqs`` (1 for the
  rotated pairs, 1e30 for the rest), the sliding layers' from freq_base_swa / dimension_count_swa; the dense MLP
  beside the experts (feed_forward_length), the router's input scale (ffn_gate_inp.scale) and per-expert scale
  (ffn_down_exps.scale); the fused ffn_gate_up_exps read as gate and up (GgufFile.split_rows). KV sharing and
  per-layer embeddings (E2B / E4B) are refused.
- kimi-linear -> kimi_linear (Kimi-Linear-48B-A3B): deepseek2's MLA keys (no rotary), the KDA layers where
  attention.head_count_kv is 0 (kda.head_dim, ssm.conv_kernel, heads from ssm_beta's rows; A_log stored as
  -exp(A_log), the convolutions as [1, C, 1, K]), sigmoid routing always renormalised.
- qwen3next -> qwen3_next: the DeltaNet's sizes from the ssm.* keys (group_count = key heads,
  time_step_rank = value heads, state_size = key head size, inner_size = all value heads), the
  layer pattern from attention.recurrent_layers; MTP layers left out as for GLM.
- qwen35moe -> qwen3_5_moe_text (Qwen3.5/3.6-MoE's language model): the same keys; its multimodal
  rotary sections (rope.dimension_sections) are the ordinary rotary for text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from moed.errors import ModelFormatError, UnsupportedModelError, quoted
from moed.weights.gguf_file import GgufFile

GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's llama_expert_gating_func_type
RECONVERT = "the file is incomplete or was not written by llama.cpp's convert_hf_to_gguf.py"


class GgufMetadata:
    """Typed reads of one architecture's keys (``{arch}.{key}``), with errors that name the key."""

    def __init__(self, file: GgufFile, arch: str) -> None:
        self.file, self.arch, self.meta = file, arch, file.metadata

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.meta

    def int(self, key: str, *, default: int | None = None, minimum: int = 0) -> int:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer array with one value
        if value is None:
            raise ModelFormatError(f"{self.file.path}: metadata {self.arch}.{key} is missing; {RECONVERT}")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            least = "positive" if minimum == 1 else f"at least {minimum}" if minimum else "non-negative"
            raise ModelFormatError(f"{self.file.path}: metadata {self.arch}.{key} should be one {least} integer, "
                                   f"got {quoted(value)} (per-layer values are not supported); the file is corrupt "
                                   "or was not written by llama.cpp's convert_hf_to_gguf.py")
        return value

    def float(self, key: str, *, default: float | None = None) -> float:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelFormatError(f"{self.file.path}: metadata {self.arch}.{key} is missing; {RECONVERT}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelFormatError(f"{self.file.path}: metadata {self.arch}.{key} should be a number, got {quoted(value)}")
        return float(value)

    def bool(self, key: str, *, default: bool) -> bool:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if not isinstance(value, bool):
            raise ModelFormatError(f"{self.file.path}: metadata {self.arch}.{key} should be a boolean, got {quoted(value)}")
        return value

    def rows(self, name: str, dim: int = 0) -> int:
        if name not in self.file:
            raise ModelFormatError(f"{self.file.path}: tensor {quoted(name)} is missing; {RECONVERT} for {self.arch}")
        return self.file.tensor(name).shape[dim]

    def common(self, *, head_dim: int | None = None, kv_heads: int | None = None) -> dict[str, Any]:
        """The fields every architecture shares (``head_dim``: the attention head size, when it is not
        attention.key_length; ``kv_heads``: the KV heads, when attention.head_count_kv is per layer)."""
        hidden, heads = self.int("embedding_length", minimum=1), self.int("attention.head_count", minimum=1)
        if head_dim is None:
            head_dim = self.int("attention.key_length", default=hidden // heads, minimum=1)
            if self.int("attention.value_length", default=head_dim) != head_dim:
                raise UnsupportedModelError(f"{self.file.path}: attention.key_length and value_length differ; moed's "
                                            "attention needs one head size")
        cfg: dict[str, Any] = {
            "vocab_size": self.rows("token_embd.weight"),
            "hidden_size": hidden,
            "num_hidden_layers": self.int("block_count", minimum=1),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads or self.int("attention.head_count_kv", default=heads, minimum=1),
            "head_dim": head_dim,
            "max_position_embeddings": self.int("context_length", minimum=1),
            "rms_norm_eps": self.float("attention.layer_norm_rms_epsilon"),
            "rope_parameters": self.rope(head_dim),
            "tie_word_embeddings": "output.weight" not in self.file,
            "hidden_act": "silu",
            "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta.get("tokenizer.ggml.eos_token_id"),
        }
        if (pad := self.meta.get("tokenizer.ggml.padding_token_id")) is not None:
            cfg["pad_token_id"] = pad
        if (dense := self.int("feed_forward_length", default=0)):
            cfg["intermediate_size"] = dense
        return cfg

    def rope(self, head_dim: int) -> dict[str, Any]:
        params: dict[str, Any] = {"rope_theta": self.float("rope.freq_base", default=10000.0)}
        dims = self.int("rope.dimension_count", default=head_dim, minimum=1)
        if dims != head_dim:
            params["partial_rotary_factor"] = dims / head_dim
        kind = self.meta.get(f"{self.arch}.rope.scaling.type", "none")
        if kind == "none":
            params["rope_type"] = "default"
        elif kind == "linear":
            params.update(rope_type="linear", factor=self.float("rope.scaling.factor"))
        elif kind == "yarn":
            params.update(rope_type="yarn", factor=self.float("rope.scaling.factor"),
                          original_max_position_embeddings=self.int("rope.scaling.original_context_length", minimum=1))
            for key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                                ("rope.scaling.yarn_attn_factor", "attention_factor")):
                if self.has(key):
                    params[hf_key] = self.float(key)
        else:
            raise UnsupportedModelError(f"{self.file.path}: rope scaling {quoted(kind)} is not supported "
                                        "(moed runs none, linear and yarn)")
        return params

    def layer_types(self, num_layers: int) -> list[str]:
        """gpt-oss's sliding/full layers from attention.sliding_window_pattern (llama.cpp's default 2:
        layer i slides when i % n < n - 1), or a per-layer list of booleans."""
        pattern = self.meta.get(f"{self.arch}.attention.sliding_window_pattern", 2)
        if isinstance(pattern, list):
            if len(pattern) != num_layers or not all(isinstance(p, bool) for p in pattern):
                raise ModelFormatError(f"{self.file.path}: attention.sliding_window_pattern should hold one boolean per "
                                       f"layer ({num_layers}), got {quoted(pattern, 200)}")
            sliding = pattern
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]
        else:
            raise ModelFormatError(f"{self.file.path}: attention.sliding_window_pattern {quoted(pattern)} is not a "
                                   "layer count or a list of booleans")
        return ["sliding_attention" if s else "full_attention" for s in sliding]

    def require_moe_layers(self, first: int, num_layers: int) -> None:
        """Layers ``first ..`` all have a router (llama.cpp's graphs for these architectures put an MoE in each)."""
        for layer in range(first, num_layers):
            if f"blk.{layer}.ffn_gate_inp.weight" not in self.file:
                raise UnsupportedModelError(
                    f"{self.file.path}: layer {layer} has no router (blk.{layer}.ffn_gate_inp.weight); llama.cpp's "
                    f"{self.arch} has an MoE in every layer there, and moed reads only what llama.cpp does")

    def experts(self) -> tuple[int, int]:
        num_experts = self.int("expert_count", minimum=1)
        top_k = self.int("expert_used_count", minimum=1)
        if top_k > num_experts:
            raise ModelFormatError(f"{self.file.path}: metadata {self.arch}.expert_used_count {top_k} is more than "
                                   f"expert_count {num_experts}; the file is corrupt")
        return num_experts, top_k

    def expert_rows(self) -> int:
        """The routed experts' intermediate size (the key, or the first MoE layer's tensor)."""
        if self.has("expert_feed_forward_length"):
            return self.int("expert_feed_forward_length", minimum=1)
        first = next((i for i in range(self.int("block_count", minimum=1))
                      if f"blk.{i}.ffn_gate_exps.weight" in self.file), 0)
        return self.rows(f"blk.{first}.ffn_gate_exps.weight", dim=1)


def _qwen3moe(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    num_experts, top_k = m.experts()
    m.require_moe_layers(0, cfg["num_hidden_layers"])
    return dict(cfg, num_experts=num_experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
                use_sliding_window=False, moe_intermediate_size=m.expert_rows(), norm_topk_prob=True,
                attention_bias="blk.0.attn_q.bias" in m.file)


def _qwen2moe(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    num_experts, top_k = m.experts()
    m.require_moe_layers(0, cfg["num_hidden_layers"])
    return dict(cfg, num_experts=num_experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
                use_sliding_window=False, moe_intermediate_size=m.expert_rows(), norm_topk_prob=False,
                qkv_bias="blk.0.attn_q.bias" in m.file,
                shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length", minimum=1,
                                                      default=m.rows("blk.0.ffn_gate_shexp.weight", dim=0)))


def _gpt_oss(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    cfg["rope_parameters"]["truncate"] = False  # gpt-oss's reference yarn keeps the correction range unrounded
    num_experts, top_k = m.experts()
    return dict(cfg, num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=m.expert_rows(),
                attention_bias=True, sliding_window=m.int("attention.sliding_window"),
                layer_types=m.layer_types(cfg["num_hidden_layers"]), swiglu_alpha=1.702, swiglu_limit=7.0)


def _olmoe(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    num_experts, top_k = m.experts()
    m.require_moe_layers(0, cfg["num_hidden_layers"])
    return dict(cfg, num_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=m.expert_rows(),
                norm_topk_prob=False, clip_qkv=None, attention_bias="blk.0.attn_q.bias" in m.file)


def _ernie4_5_moe(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    n = cfg["num_hidden_layers"]
    num_experts, top_k = m.experts()
    start = m.int("leading_dense_block_count", default=1)
    step = m.int("interleave_moe_layer_step", default=1, minimum=1)
    routed = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in m.file]
    expected = [i for i in range(n) if (i + 1) % step == 0 and i >= start]
    if routed != expected[:len(routed)] or not routed:
        raise ModelFormatError(f"{m.file.path}: the layers with a router ({routed[:8]}) do not follow "
                               f"leading_dense_block_count={start} and interleave_moe_layer_step={step}")
    dense = next((i for i in range(n) if f"blk.{i}.ffn_gate.weight" in m.file), None)
    return dict(cfg, moe_num_experts=num_experts, moe_k=top_k, moe_intermediate_size=m.expert_rows(),
                moe_num_shared_experts=m.int("expert_shared_count", default=0), moe_layer_start_index=start,
                moe_layer_interval=step, moe_layer_end_index=routed[-1], use_bias=False,
                intermediate_size=m.rows(f"blk.{dense}.ffn_gate.weight") if dense is not None
                else m.expert_rows())


def _minimax_m2(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    num_experts, top_k = m.experts()
    m.require_moe_layers(0, cfg["num_hidden_layers"])
    return dict(cfg, num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=m.expert_rows(),
                use_qk_norm="blk.0.attn_q_norm.weight" in m.file)


LLAMA4_CHUNK, LLAMA4_FLOOR_SCALE, LLAMA4_ATTN_SCALE, LLAMA4_NOPE_EVERY = 8192, 8192, 0.1, 4  # llama.cpp's llama4


def _llama4(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    n = cfg["num_hidden_layers"]
    num_experts, top_k = m.experts()
    step = m.int("interleave_moe_layer_step", default=1, minimum=1)
    routed = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in m.file]
    if routed != [i for i in range(n) if (i + 1) % step == 0]:
        raise ModelFormatError(f"{m.file.path}: the layers with a router ({routed[:8]}) are not every "
                               f"interleave_moe_layer_step={step}th layer; {RECONVERT}")
    if "rope_freqs.weight" in m.file:  # llama3 scaling, written as the divisor of each frequency
        stored = m.file.tensor("rope_freqs.weight")
        factors = m.file.read("rope_freqs.weight").view(torch.float32).reshape(-1) \
            if stored.type_name == "F32" and stored.nbytes % 4 == 0 else None
        if factors is None or factors.numel() != cfg["head_dim"] // 2 or not bool(torch.isfinite(factors).all()) \
                or bool((factors <= 0).any()):
            raise ModelFormatError(f"{m.file.path}: rope_freqs.weight should hold {cfg['head_dim'] // 2} positive F32 "
                                   f"factors; {RECONVERT}")
        cfg["rope_parameters"] = dict(cfg["rope_parameters"], rope_type="factors", freq_factors=factors.tolist())
    chunked = not (m.has("attention.sliding_window") and m.int("attention.sliding_window") == 0)
    uses_rope = [int(not chunked or (i + 1) % LLAMA4_NOPE_EVERY != 0) for i in range(n)]
    cfg.pop("intermediate_size", None)
    return dict(cfg, num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=m.expert_rows(),
                intermediate_size_mlp=m.int("feed_forward_length", default=0), moe_layers=routed,
                interleave_moe_layer_step=step, no_rope_layers=uses_rope,
                attention_chunk_size=LLAMA4_CHUNK if chunked else None,
                layer_types=["chunked_attention" if r and chunked else "full_attention" for r in uses_rope],
                attn_temperature_tuning=chunked, floor_scale=LLAMA4_FLOOR_SCALE, attn_scale=LLAMA4_ATTN_SCALE,
                use_qk_norm=num_experts != 128, attention_bias="blk.0.attn_q.bias" in m.file)


def _gemma4(m: GgufMetadata) -> dict[str, Any]:
    n = m.int("block_count", minimum=1)
    if m.int("attention.shared_kv_layers", default=0) or m.int("embedding_length_per_layer_input", default=0):
        raise UnsupportedModelError(f"{m.file.path}: a Gemma-4 with KV sharing / per-layer embeddings (E2B / E4B); moed "
                                    "runs the Gemma-4 models without them (26B-A4B, 31B)")
    types = m.layer_types(n)
    kv = _per_block(m, "attention.head_count_kv", n)
    shapes = {t: {kv[i] for i in range(n) if types[i] == t} for t in ("sliding_attention", "full_attention")}
    if any(len(v) > 1 for v in shapes.values()) or not shapes["sliding_attention"] or 0 in kv:
        raise UnsupportedModelError(f"{m.file.path}: attention.head_count_kv {kv} gives layers of one kind different "
                                    "KV heads (or no sliding layer); moed runs one shape per kind")
    swa_dim, full_dim = m.int("attention.key_length_swa", minimum=1), m.int("attention.key_length", minimum=1)
    if m.int("attention.value_length_swa", default=swa_dim) != swa_dim or \
            m.int("attention.value_length", default=full_dim) != full_dim:
        raise UnsupportedModelError(f"{m.file.path}: key and value head sizes differ; moed's attention needs one")
    cfg = m.common(head_dim=swa_dim, kv_heads=shapes["sliding_attention"].pop())
    full = [i for i in range(n) if types[i] == "full_attention"]
    # the full layers' "proportional" rotary: rope_freqs holds 1 for each rotated pair, 1e30 for the others
    rotated = full_dim // 2
    if "rope_freqs.weight" in m.file:
        stored = m.file.tensor("rope_freqs.weight")
        factors = m.file.read("rope_freqs.weight").view(torch.float32).reshape(-1) \
            if stored.type_name == "F32" and stored.nbytes % 4 == 0 else None
        rotated = int((factors == 1.0).sum()) if factors is not None else -1
        if factors is None or factors.numel() != full_dim // 2 or not bool((factors[:rotated] == 1.0).all()) \
                or not bool((factors[rotated:] >= 1e29).all()):
            raise ModelFormatError(f"{m.file.path}: rope_freqs.weight should hold {full_dim // 2} F32 factors, 1 for "
                                   f"the rotated pairs then 1e30; {RECONVERT}")
    swa_rot = m.int("rope.dimension_count_swa", default=swa_dim, minimum=1)
    sliding_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.float("rope.freq_base_swa", default=10000.0)}
    if swa_rot != swa_dim:
        sliding_rope["partial_rotary_factor"] = swa_rot / swa_dim
    moe = "blk.0.ffn_gate_inp.weight" in m.file
    if moe:
        m.require_moe_layers(0, n)
        num_experts, top_k = m.experts()
        cfg.update(num_experts=num_experts, top_k_experts=top_k,
                   moe_intermediate_size=m.int("expert_feed_forward_length", minimum=1))
    return dict(cfg, hidden_activation="gelu_pytorch_tanh", layer_types=types,
                sliding_window=m.int("attention.sliding_window", minimum=1), enable_moe_block=moe,
                per_layer_config={str(i): {"head_dim": full_dim, "num_key_value_heads": kv[i]} for i in full},
                global_head_dim=full_dim, attention_k_eq_v=bool(full) and f"blk.{full[0]}.attn_v.weight" not in m.file,
                final_logit_softcapping=m.float("final_logit_softcapping", default=0.0),
                hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                rope_parameters={"sliding_attention": sliding_rope,
                                 "full_attention": {"rope_type": "proportional", "rope_theta": m.float("rope.freq_base"),
                                                    "partial_rotary_factor": rotated / (full_dim // 2)}})


def _per_block(m: GgufMetadata, key: str, blocks: int) -> list[int]:
    value = m.meta.get(f"{m.arch}.{key}", 0)
    values = value if isinstance(value, list) else [value] * blocks
    if len(values) != blocks or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelFormatError(f"{m.file.path}: metadata {m.arch}.{key} should hold a count for each of the {blocks} "
                               f"blocks, got {quoted(value, 200)}; {RECONVERT}")
    return values


def _nemotron_h_moe(m: GgufMetadata) -> dict[str, Any]:
    blocks = m.int("block_count", minimum=1)
    kv, ffn = _per_block(m, "attention.head_count_kv", blocks), _per_block(m, "feed_forward_length", blocks)
    pattern = ""
    for b in range(blocks):
        if kv[b]:
            pattern += "*"
        elif ffn[b]:
            pattern += "E"
        elif f"blk.{b}.ssm_in.weight" in m.file:
            pattern += "M"
        elif f"blk.{b}.ffn_up.weight" in m.file:
            pattern += "-"
        else:
            raise ModelFormatError(f"{m.file.path}: block {b} is no attention, MoE, Mamba-2 or MLP block; {RECONVERT}")
    heads, inner = m.int("ssm.time_step_rank", minimum=1), m.int("ssm.inner_size", minimum=1)
    if inner % heads:
        raise ModelFormatError(f"{m.file.path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank "
                               f"{heads}; the file is corrupt")
    hidden, attn_heads = m.int("embedding_length", minimum=1), m.int("attention.head_count", minimum=1)
    dense = next((b for b in range(blocks) if pattern[b] == "-"), None)
    cfg: dict[str, Any] = {
        "vocab_size": m.rows("token_embd.weight"), "hidden_size": hidden, "hybrid_override_pattern": pattern,
        "num_attention_heads": attn_heads, "num_key_value_heads": max(kv) or attn_heads,
        "head_dim": m.int("attention.key_length", default=hidden // attn_heads, minimum=1),
        "max_position_embeddings": m.int("context_length", minimum=1),
        "layer_norm_epsilon": m.float("attention.layer_norm_epsilon", default=1e-5),
        "tie_word_embeddings": "output.weight" not in m.file, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
        "bos_token_id": m.meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": m.meta.get("tokenizer.ggml.eos_token_id"),
        "mamba_num_heads": heads, "mamba_head_dim": inner // heads, "n_groups": m.int("ssm.group_count", minimum=1),
        "ssm_state_size": m.int("ssm.state_size", minimum=1), "conv_kernel": m.int("ssm.conv_kernel", minimum=1),
        "use_conv_bias": any(f"blk.{b}.ssm_conv1d.bias" in m.file for b in range(blocks)),
        "use_bias": any(f"blk.{b}.ssm_in.bias" in m.file for b in range(blocks)),
        "intermediate_size": m.rows(f"blk.{dense}.ffn_up.weight") if dense is not None else 1,
    }
    if "E" in pattern:
        num_experts, top_k = m.experts()
        cfg.update(n_routed_experts=num_experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=m.int("expert_feed_forward_length", minimum=1),
                   n_shared_experts=m.int("expert_shared_count", default=0),
                   moe_shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length", default=0),
                   norm_topk_prob=m.bool("expert_weights_norm", default=True),
                   routed_scaling_factor=m.float("expert_weights_scale", default=1.0),
                   n_group=m.int("expert_group_count", default=1, minimum=1),
                   topk_group=m.int("expert_group_used_count", default=1, minimum=1))
    return cfg


def _nemotron_blocks(raw: dict[str, Any]) -> list[tuple[int, int | None]]:
    from moed.models.families.nemotron_h import block_kinds, pair_blocks

    return pair_blocks(block_kinds(raw))


def _mixtral(m: GgufMetadata) -> dict[str, Any]:
    if not m.has("expert_count") or "blk.0.ffn_gate_exps.weight" not in m.file:
        raise UnsupportedModelError(f"{m.file.path}: a dense Llama model (no experts); moed runs Mixture-of-Experts "
                                    "models (Mixtral is the llama architecture with experts)")
    cfg = m.common()
    num_experts, top_k = m.experts()
    m.require_moe_layers(0, cfg["num_hidden_layers"])
    return dict(cfg, num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=m.expert_rows(),
                sliding_window=None)


def _sigmoid_group_experts(m: GgufMetadata, num_layers: int, gating_default: int = GATING_SOFTMAX) -> dict[str, Any]:
    """DeepSeek-V3 / GLM-4-MoE routing: sigmoid scores with a correction bias, group-limited top-k."""
    gating = m.int("expert_gating_func", default=gating_default)
    if gating != GATING_SIGMOID:
        raise UnsupportedModelError(
            f"{m.file.path}: routed by {'softmax' if gating == GATING_SOFTMAX else f'gating function {gating}'} "
            f"({m.arch}.expert_gating_func; llama.cpp's default for files without it is softmax, DeepSeek-V2's); "
            "moed runs the sigmoid-routed models of this architecture (DeepSeek-V3/R1, Kimi-K2, GLM-4.5+)")
    num_experts, top_k = m.experts()
    first_dense = m.int("leading_dense_block_count", default=0)
    m.require_moe_layers(first_dense, num_layers)
    return dict(n_routed_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=m.expert_rows(),
                n_shared_experts=m.int("expert_shared_count", default=0),
                routed_scaling_factor=m.float("expert_weights_scale", default=1.0),
                norm_topk_prob=m.bool("expert_weights_norm", default=False),
                n_group=m.int("expert_group_count", default=1, minimum=1),
                topk_group=m.int("expert_group_used_count", default=1, minimum=1),
                first_k_dense_replace=first_dense, scoring_func="sigmoid")


def _deepseek2(m: GgufMetadata, gating_default: int = GATING_SOFTMAX, *, kv_heads: int | None = None) -> dict[str, Any]:
    rope_dim = m.int("rope.dimension_count", minimum=1)
    if m.has("attention.key_length_mla"):  # llama.cpp's MLA layout: key_length is the absorbed kv_lora + rope
        qk_head, v_head = m.int("attention.key_length_mla", minimum=1), m.int("attention.value_length_mla", minimum=1)
    else:  # files written before it: the plain head sizes
        qk_head, v_head = m.int("attention.key_length", minimum=1), m.int("attention.value_length", minimum=1)
    if qk_head <= rope_dim:
        raise ModelFormatError(f"{m.file.path}: the key head size {qk_head} is not larger than the rotary part "
                               f"{rope_dim}; the file is corrupt")
    cfg = m.common(head_dim=rope_dim, kv_heads=kv_heads)
    heads = cfg["num_attention_heads"]
    rope = cfg["rope_parameters"]
    rope.pop("partial_rotary_factor", None)  # MLA's rotary part has its own head size (qk_rope_head_dim)
    if rope["rope_type"] == "yarn" and m.has("rope.scaling.yarn_log_multiplier"):
        # llama.cpp writes 0.1 * mscale_all_dim (its [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]); the released
        # configs give mscale the same value, which makes yarn's own attention factor 1
        rope["mscale_all_dim"] = rope["mscale"] = m.float("rope.scaling.yarn_log_multiplier") / 0.1
    q_lora = m.int("attention.q_lora_rank", default=0)
    cfg.update(num_key_value_heads=heads, head_dim=qk_head, qk_nope_head_dim=qk_head - rope_dim,
               qk_rope_head_dim=rope_dim, v_head_dim=v_head, kv_lora_rank=m.int("attention.kv_lora_rank", minimum=1),
               q_lora_rank=q_lora or None, attention_bias=False, rope_interleave=True,
               **_sigmoid_group_experts(m, cfg["num_hidden_layers"], gating_default))
    return cfg


def _glm_dsa(m: GgufMetadata) -> dict[str, Any]:
    """GLM-5: deepseek2's MLA keys, its multi-token-prediction layers appended to block_count (left out), the
    lightning indexer's sizes and which layers run one (attention.indexer.types; files written before the key
    existed tell by which layers hold indexer tensors). Always sigmoid-routed."""
    cfg = _deepseek2(m, GATING_SIGMOID)
    layers = cfg["num_hidden_layers"] - m.int("nextn_predict_layers", default=0)
    if layers < 1:
        raise ModelFormatError(f"{m.file.path}: block_count {cfg['num_hidden_layers']} leaves no layer besides the "
                               "multi-token-prediction ones; the file is corrupt")
    types = m.meta.get(f"{m.arch}.attention.indexer.types")
    if types is None:
        types = [f"blk.{i}.indexer.attn_k.weight" in m.file for i in range(layers)]
    if not isinstance(types, list) or len(types) < layers or not all(isinstance(t, bool) for t in types):
        raise ModelFormatError(f"{m.file.path}: metadata {m.arch}.attention.indexer.types should hold a boolean for "
                               f"each of the {layers} layers, got {quoted(types, 200)}")
    cfg.update(num_hidden_layers=layers, **_sigmoid_group_experts(m, layers, GATING_SIGMOID),
               index_n_heads=m.int("attention.indexer.head_count", minimum=1),
               index_head_dim=m.int("attention.indexer.key_length", minimum=1),
               index_topk=m.int("attention.indexer.top_k", minimum=1),
               indexer_types=["full" if t else "shared" for t in types[:layers]])
    return cfg


def _glm4_moe_lite(m: GgufMetadata) -> dict[str, Any]:
    """GLM-4.7-Flash: deepseek2's MLA keys, sigmoid routing, its multi-token-prediction layers appended to
    block_count (left out)."""
    cfg = _deepseek2(m, GATING_SIGMOID)
    layers = cfg["num_hidden_layers"] - m.int("nextn_predict_layers", default=0)
    if layers < 1:
        raise ModelFormatError(f"{m.file.path}: block_count {cfg['num_hidden_layers']} leaves no layer besides the "
                               "multi-token-prediction ones; the file is corrupt")
    cfg.update(num_hidden_layers=layers, **_sigmoid_group_experts(m, layers, GATING_SIGMOID))
    return cfg


def _kimi_linear(m: GgufMetadata) -> dict[str, Any]:
    """Kimi-Linear: deepseek2's MLA keys (its layers use no rotary: ``mla_use_nope``), the KDA layers where
    attention.head_count_kv is 0, their sizes from kda.head_dim, ssm.conv_kernel and the beta projection's rows
    (the KDA heads), sigmoid routing always renormalised (llama.cpp's graph for this architecture)."""
    n = m.int("block_count", minimum=1)
    kv = _per_block(m, "attention.head_count_kv", n)
    kda = [i for i in range(n) if kv[i] == 0]
    cfg = _deepseek2(m, GATING_SIGMOID, kv_heads=max(kv) or 1)
    if len(kda) == n:
        raise ModelFormatError(f"{m.file.path}: attention.head_count_kv is 0 for every layer (no MLA layer); {RECONVERT}")
    cfg.update(mla_use_nope=True, norm_topk_prob=True, rope_interleave=False,
               linear_attn_config={"kda_layers": [i + 1 for i in kda],
                                   "full_attn_layers": [i + 1 for i in range(n) if kv[i]],
                                   "head_dim": m.int("kda.head_dim", minimum=1),
                                   "num_heads": m.rows(f"blk.{kda[0]}.ssm_beta.weight") if kda else 1,
                                   "short_conv_kernel_size": m.int("ssm.conv_kernel", minimum=1)})
    return cfg


def is_kimi_template(meta: dict) -> bool:
    """The file's chat template is Moonshot's (Kimi-K2: ``<|im_middle|>`` between a turn's role and its text)."""
    template = meta.get("tokenizer.chat_template")
    return isinstance(template, str) and "<|im_middle|>" in template


def is_glm_template(meta: dict) -> bool:
    """The file's chat template is GLM's (it opens every conversation with ``[gMASK]``)."""
    template = meta.get("tokenizer.chat_template")
    return isinstance(template, str) and "[gMASK]" in template


def _glm4moe(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    extra = m.int("nextn_predict_layers", default=0)
    layers = cfg["num_hidden_layers"] - extra
    if layers < 1:
        raise ModelFormatError(f"{m.file.path}: block_count {cfg['num_hidden_layers']} leaves no layer besides the "
                               f"{extra} multi-token-prediction ones; the file is corrupt")
    cfg.update(num_hidden_layers=layers, attention_bias="blk.0.attn_q.bias" in m.file,
               use_qk_norm="blk.0.attn_q_norm.weight" in m.file, **_sigmoid_group_experts(m, layers))
    return cfg


def _qwen3next(m: GgufMetadata) -> dict[str, Any]:
    cfg = m.common()
    layers = cfg["num_hidden_layers"] - m.int("nextn_predict_layers", default=0)  # MTP layers, when converted
    if layers < 1:
        raise ModelFormatError(f"{m.file.path}: block_count leaves no layer besides the multi-token-prediction ones; "
                               "the file is corrupt")
    recurrent = m.meta.get(f"{m.arch}.attention.recurrent_layers")
    if recurrent is None:  # llama.cpp's fallback: every full_attention_interval-th layer attends
        interval = m.int("full_attention_interval", default=4, minimum=1)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    if not isinstance(recurrent, list) or len(recurrent) < layers or not all(isinstance(r, bool) for r in recurrent):
        raise ModelFormatError(f"{m.file.path}: metadata {m.arch}.attention.recurrent_layers should hold a boolean for "
                               f"each of the {layers} layers, got {quoted(recurrent, 200)}")
    num_experts, top_k = m.experts()
    m.require_moe_layers(0, layers)
    cfg.pop("intermediate_size", None)  # every layer is MoE (the converter may write an unused default)
    v_heads = m.int("ssm.time_step_rank", minimum=1)
    inner = m.int("ssm.inner_size", minimum=1)
    if inner % v_heads:
        raise ModelFormatError(f"{m.file.path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank "
                               f"{v_heads} (the value heads); the file is corrupt")
    cfg.update(num_hidden_layers=layers,
               layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
               linear_num_key_heads=m.int("ssm.group_count", minimum=1), linear_num_value_heads=v_heads,
               linear_key_head_dim=m.int("ssm.state_size", minimum=1), linear_value_head_dim=inner // v_heads,
               linear_conv_kernel_dim=m.int("ssm.conv_kernel", minimum=1),
               num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=m.expert_rows(),
               shared_expert_intermediate_size=m.int("expert_shared_feed_forward_length", minimum=1,
                                                     default=m.rows("blk.0.ffn_gate_shexp.weight", dim=0)),
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
               attention_bias=f"blk.{recurrent.index(False) if False in recurrent else 0}.attn_q.bias" in m.file)
    return cfg


@dataclass(frozen=True)
class GgufArchitecture:
    """How one llama.cpp architecture reads: the moed family and HF class it is, its config builder."""

    family: str
    hf_class: str
    what: str
    build: Callable[[GgufMetadata], dict[str, Any]]
    post_attention_norm: str = "ffn_norm"  # llama.cpp's name for the norm before the MLP
    permuted_qk: bool = False  # the converter permuted Q/K rows (its "llama" architecture only)
    # the GGUF blocks of each moed layer, (mixer block, feed-forward block or None), from the config dict; None:
    # block i is layer i (Nemotron-H pairs a mixer block with the feed-forward block after it)
    layer_blocks: Callable[[dict[str, Any]], list[tuple[int, int | None]]] | None = None


ARCHITECTURES: dict[str, GgufArchitecture] = {
    "qwen3moe": GgufArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", _qwen3moe),
    "qwen2moe": GgufArchitecture("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen1.5/Qwen2-MoE", _qwen2moe),
    "gpt-oss": GgufArchitecture("gpt_oss", "GptOssForCausalLM", "gpt-oss", _gpt_oss, "post_attention_norm"),
    "olmoe": GgufArchitecture("olmoe", "OlmoeForCausalLM", "OLMoE", _olmoe),
    "llama": GgufArchitecture("mixtral", "MixtralForCausalLM", "Mixtral", _mixtral, permuted_qk=True),
    "deepseek2": GgufArchitecture("deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-V3/R1, Kimi-K2", _deepseek2),
    "glm4moe": GgufArchitecture("glm4_moe", "Glm4MoeForCausalLM", "GLM-4.5/4.6/4.7", _glm4moe,
                                "post_attention_norm"),
    "glm-dsa": GgufArchitecture("glm_moe_dsa", "GlmMoeDsaForCausalLM", "GLM-5", _glm_dsa),
    "ernie4_5-moe": GgufArchitecture("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "ERNIE-4.5-MoE", _ernie4_5_moe),
    "minimax-m2": GgufArchitecture("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMax-M2", _minimax_m2),
    "llama4": GgufArchitecture("llama4_text", "Llama4ForCausalLM", "Llama-4", _llama4),
    "nemotron_h_moe": GgufArchitecture("nemotron_h", "NemotronHForCausalLM", "Nemotron-3-Nano", _nemotron_h_moe,
                                       "attn_norm", layer_blocks=_nemotron_blocks),
    "gemma4": GgufArchitecture("gemma4_text", "Gemma4ForCausalLM", "Gemma-4", _gemma4, "post_attention_norm"),
    "kimi-linear": GgufArchitecture("kimi_linear", "KimiLinearForCausalLM", "Kimi-Linear", _kimi_linear),
    "qwen3next": GgufArchitecture("qwen3_next", "Qwen3NextForCausalLM", "Qwen3-Next", _qwen3next,
                                  "post_attention_norm"),
    "qwen35moe": GgufArchitecture("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3.5/3.6-MoE", _qwen3next,
                                  "post_attention_norm"),
}


GLM_LITE = GgufArchitecture("glm4_moe_lite", "Glm4MoeLiteForCausalLM", "GLM-4.7-Flash", _glm4_moe_lite)
KIMI_K2 = GgufArchitecture("kimi_k2", "DeepseekV3ForCausalLM", "Kimi-K2", _deepseek2)


def read_config(file: GgufFile, arch: str) -> dict[str, Any]:
    """The config.json of ``file`` (an architecture of ``ARCHITECTURES``; deepseek2 with GLM's template is
    GLM-4.7-Flash, with Moonshot's Kimi-K2)."""
    spec = ARCHITECTURES[arch]
    if arch == "deepseek2" and is_glm_template(file.metadata):
        spec = GLM_LITE
    elif arch == "deepseek2" and is_kimi_template(file.metadata):
        spec = KIMI_K2
    cfg = spec.build(GgufMetadata(file, arch))
    return {"model_type": spec.family, "architectures": [spec.hf_class], **cfg}
