"""Upcycle a dense Llama checkpoint into an equivalent Mixtral (MoE) checkpoint.

Every expert of every layer is an exact copy of that layer's dense MLP. Mixtral
renormalises the top-k softmax routing weights so that they sum to 1, hence

    moe(h) = sum_k w_k * expert_k(h) = (sum_k w_k) * mlp(h) = mlp(h)

and the upcycled model computes the same function as the dense one (up to float
rounding in the weighted sum). The router weights are therefore free: they are
drawn at random (seeded) so that different tokens pick different expert sets,
which exercises the whole MoE machinery (expert selection, expert caching,
per-expert offloading) with a small model whose answers are known to be good.
Their scale (``router_scale``) only changes how peaked the routing
probabilities are and which experts win; it never changes the model's outputs.

Pure torch on purpose: no transformers import. The output uses the standard
Hugging Face hub naming for Mixtral (``block_sparse_moe.experts.{e}.w1/w2/w3``),
which is what published Mixtral checkpoints use and what transformers converts
on load.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import Tensor

from moed.errors import UnsupportedModelError

__all__ = ["NotPlainLlamaError", "upcycle_dense_to_mixtral"]

#: Default router scale: router weights are drawn from N(0, (router_scale / sqrt(hidden))^2),
#: so a router logit has a standard deviation of about ``router_scale * rms(h)`` for a
#: normalised hidden state ``h``: varied routing, softmax far from saturation.
DEFAULT_ROUTER_SCALE = 1.0

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# dense MLP projection -> Mixtral expert name
_MLP_TO_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class NotPlainLlamaError(UnsupportedModelError, ValueError):
    """The dense checkpoint is not a plain Llama that Mixtral can represent exactly."""


def _check_plain_llama(cfg: dict[str, Any]) -> None:
    problems: list[str] = []
    model_type = cfg.get("model_type", "llama")
    if model_type != "llama":
        problems.append(f"model_type is {model_type!r}, expected 'llama'")
    archs = cfg.get("architectures") or []
    if any(a != "LlamaForCausalLM" for a in archs):
        problems.append(f"architectures is {archs!r}, expected ['LlamaForCausalLM']")
    if cfg.get("attention_bias", False):
        problems.append("attention_bias=True (Mixtral attention has no bias)")
    if cfg.get("mlp_bias", False):
        problems.append("mlp_bias=True (Mixtral experts have no bias)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act is {act!r} (Mixtral experts use 'silu')")
    if cfg.get("quantization_config"):
        qm = cfg["quantization_config"]
        method = str(qm.get("quant_method", "")) if isinstance(qm, dict) else str(qm)
        # GGUF checkpoints loaded by transformers are de-quantised to float tensors: fine.
        if "gguf" not in method.lower():
            problems.append(f"quantization_config present ({method}); upcycle a float checkpoint")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            problems.append(f"{key} missing or not a positive int ({cfg.get(key)!r})")
    if problems:
        raise NotPlainLlamaError(
            "cannot upcycle this checkpoint to Mixtral, it is not a plain Llama: " + "; ".join(problems)
        )


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rope settings in the transformers-5 ``rope_parameters`` form."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        out = dict(rp)
    else:
        out = {}
        scaling = cfg.get("rope_scaling")
        if isinstance(scaling, dict) and scaling:
            out.update(scaling)
            if "type" in out and "rope_type" not in out:
                out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    if "rope_theta" not in out:
        out["rope_theta"] = float(cfg.get("rope_theta", 10000.0))
    out["rope_theta"] = float(out["rope_theta"])
    return out


def upcycle_dense_to_mixtral(
    llama_config: dict,
    state_dict: dict[str, Tensor],
    *,
    num_experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    router_scale: float = DEFAULT_ROUTER_SCALE,
) -> tuple[dict, dict[str, Tensor]]:
    """Turn a dense Llama (config dict + state dict) into an equivalent Mixtral.

    Args:
        llama_config: the Llama ``config.json`` as a dict (``LlamaConfig.to_dict()`` works;
            both the transformers-5 ``rope_parameters`` and the older ``rope_theta``/
            ``rope_scaling`` forms are read).
        state_dict: the Llama weights with HF names (``model.embed_tokens.weight``,
            ``model.layers.{i}.mlp.gate_proj.weight``, ..., optional ``lm_head.weight``).
            ``model.rotary_emb.inv_freq`` buffers are ignored; any other unknown key
            (e.g. a bias) is refused.
        num_experts: experts per layer (``num_local_experts``).
        top_k: experts used per token (``num_experts_per_tok``), 1 <= top_k <= num_experts.
        seed: seed for the random router weights (deterministic output).
        router_scale: router weights ~ N(0, (router_scale / sqrt(hidden_size))^2). Only
            affects which experts are picked and how peaked the routing is, never the
            model's outputs (all experts are identical and the top-k weights sum to 1).

    Returns:
        ``(mixtral_config, mixtral_state_dict)``: a Mixtral ``config.json`` dict and a state
        dict with the hub naming (``model.layers.{i}.block_sparse_moe.gate.weight`` [E, D],
        ``...block_sparse_moe.experts.{e}.w1/w2/w3.weight``). All returned tensors are
        contiguous and own their memory (no two share storage), so they can be passed to
        ``safetensors.torch.save_file`` directly. ``lm_head.weight`` is omitted when the
        embeddings are tied.

    Raises:
        NotPlainLlamaError (a ValueError): the config is not a plain Llama (attention or
            MLP bias, non-silu activation, other model type, ...), or the state dict does
            not match it.
        ValueError: bad ``num_experts`` / ``top_k`` / ``router_scale``.
    """
    if not isinstance(llama_config, dict):
        raise TypeError(f"llama_config must be a dict, got {type(llama_config).__name__}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if not (isinstance(router_scale, (int, float)) and math.isfinite(router_scale) and router_scale > 0):
        raise ValueError(f"router_scale must be a finite positive number, got {router_scale!r}")

    cfg = llama_config
    _check_plain_llama(cfg)

    hidden = cfg["hidden_size"]
    inter = cfg["intermediate_size"]
    n_layers = cfg["num_hidden_layers"]
    n_heads = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or hidden // n_heads
    vocab = cfg["vocab_size"]
    tied = bool(cfg.get("tie_word_embeddings", False))

    # ---- sort the dense tensors -------------------------------------------------------
    top: dict[str, Tensor] = {}
    layers: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]
    unknown: list[str] = []
    for name, t in state_dict.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        m = _LAYER_KEY.match(name)
        if m:
            idx = int(m.group(1))
            if idx >= n_layers:
                unknown.append(name)
            else:
                layers[idx][m.group(2)] = t
        elif name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            top[name] = t
        else:
            unknown.append(name)
    if unknown:
        raise NotPlainLlamaError(
            f"unexpected tensors for a plain Llama ({len(unknown)}): " + ", ".join(sorted(unknown)[:8])
        )

    expected_layer = {
        **{f"self_attn.{p}.weight": None for p in _ATTN},
        **{f"mlp.{p}.weight": None for p in _MLP_TO_EXPERT},
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    shapes = {
        "self_attn.q_proj.weight": (n_heads * head_dim, hidden),
        "self_attn.k_proj.weight": (n_kv * head_dim, hidden),
        "self_attn.v_proj.weight": (n_kv * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, n_heads * head_dim),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    problems: list[str] = []

    def check(name: str, t: Tensor | None, shape: tuple[int, ...]) -> None:
        if t is None:
            problems.append(f"missing {name}")
        elif not t.is_floating_point():
            problems.append(f"{name} has dtype {t.dtype} (expected a float tensor)")
        elif tuple(t.shape) != shape:
            problems.append(f"{name} has shape {tuple(t.shape)}, config says {shape}")

    check("model.embed_tokens.weight", top.get("model.embed_tokens.weight"), (vocab, hidden))
    check("model.norm.weight", top.get("model.norm.weight"), (hidden,))
    if not tied:
        check("lm_head.weight", top.get("lm_head.weight"), (vocab, hidden))
    for i, lay in enumerate(layers):
        extra = sorted(set(lay) - set(expected_layer))
        if extra:
            problems.append(f"unexpected tensors in layer {i}: {', '.join(extra)}")
        for suffix, shape in shapes.items():
            check(f"model.layers.{i}.{suffix}", lay.get(suffix), shape)
    if problems:
        raise NotPlainLlamaError(
            "the state dict does not match a plain Llama with this config: " + "; ".join(problems[:8])
            + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else "")
        )

    # ---- build the Mixtral state dict -------------------------------------------------
    def own(t: Tensor) -> Tensor:
        return t.detach().clone(memory_format=torch.contiguous_format)

    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    std = float(router_scale) / math.sqrt(hidden)

    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": own(top["model.embed_tokens.weight"]),
        "model.norm.weight": own(top["model.norm.weight"]),
    }
    if not tied:
        out["lm_head.weight"] = own(top["lm_head.weight"])
    for i, lay in enumerate(layers):
        pre = f"model.layers.{i}."
        for p in _ATTN:
            out[f"{pre}self_attn.{p}.weight"] = own(lay[f"self_attn.{p}.weight"])
        out[f"{pre}input_layernorm.weight"] = own(lay["input_layernorm.weight"])
        out[f"{pre}post_attention_layernorm.weight"] = own(lay["post_attention_layernorm.weight"])
        ref = lay["mlp.gate_proj.weight"]
        router = torch.randn((num_experts, hidden), generator=gen, dtype=torch.float32) * std
        out[f"{pre}block_sparse_moe.gate.weight"] = router.to(dtype=ref.dtype, device=ref.device).contiguous()
        for e in range(num_experts):
            for dense_name, w in _MLP_TO_EXPERT.items():
                out[f"{pre}block_sparse_moe.experts.{e}.{w}.weight"] = own(lay[f"mlp.{dense_name}.weight"])

    # ---- config -------------------------------------------------------------------------
    rope = _rope(cfg)
    mix_cfg: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)),
        "initializer_range": float(cfg.get("initializer_range", 0.02)),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "use_cache": True,
        "pad_token_id": cfg.get("pad_token_id"),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "tie_word_embeddings": tied,
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],  # top-level copy for pre-5 readers
        "sliding_window": None,
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
        "num_experts_per_tok": top_k,
        "num_local_experts": num_experts,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "dtype": _DTYPE_NAMES.get(out["model.embed_tokens.weight"].dtype, "float32"),
    }
    if rope.get("rope_type", "default") != "default":
        # pre-5 readers look for rope_scaling
        mix_cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return mix_cfg, out
