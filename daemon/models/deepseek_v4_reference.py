"""DeepSeek-V4's forward pass over one whole sequence in plain torch (issue #33): the composition of its parts as
the model runs them, and the oracle the paged, engine-driven model will be tested against.

    streams = expand(embed(ids))                                  [T, n, D]
    per layer: post, comb, x = mixes(streams)   (attention's hyper-connection)
               streams = merge(streams, attention(attn_norm(x)), post, comb)
               post, comb, x = mixes(streams)   (the MoE's)
               streams = merge(streams, moe(ffn_norm(x), ids), post, comb)
    logits = lm_head(norm(head_collapse(streams)))

The MoE: sqrt-softplus scores, the top-k by score + correction bias (or a hash layer's tid2eid row of each token),
the chosen scores renormalised and scaled, clamped SwiGLU routed experts plus the clamped SwiGLU shared expert.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moed.layers import hyper_connections as hc
from moed.layers.compressed_attention import CompressedAttentionWeights, attend_sequence
from moed.layers.moe import route
from moed.layers.rotary import RotaryEmbedding
from moed.models.model_config import ModelConfig

# (layer, expert) -> (gate [I, D], up [I, D], down [D, I]) of one routed expert
ExpertReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def _clamped_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, limit: float
                    ) -> torch.Tensor:
    g = (x @ gate.float().t()).clamp(max=limit)
    u = (x @ up.float().t()).clamp(min=-limit, max=limit)
    return (F.silu(g) * u) @ down.float().t()


def _moe(config: ModelConfig, weights: dict[str, torch.Tensor], experts: ExpertReader, layer: int, x: torch.Tensor,
         token_ids: torch.Tensor) -> torch.Tensor:
    moe, m = config.moe, f"model.layers.{layer}.mlp"
    table = weights.get(f"{m}.router.tid2eid")
    ids, gates = route(moe, x, weights[f"{m}.router.weight"], None, weights.get(f"{m}.router.score_bias"),
                       token_ids=token_ids, table=table)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        gate, up, down = experts(layer, e)
        y = _clamped_swiglu(x[rows], gate, up, down, moe.swiglu_limit)
        out.index_add_(0, rows, y * gates[rows, slots, None])
    shared = _clamped_swiglu(x, weights[f"{m}.shared.gate_proj.weight"], weights[f"{m}.shared.up_proj.weight"],
                             weights[f"{m}.shared.down_proj.weight"], moe.swiglu_limit)
    return out + shared


def forward_sequence(config: ModelConfig, weights: dict[str, torch.Tensor], experts: ExpertReader,
                     token_ids: torch.Tensor) -> torch.Tensor:
    """``token_ids [T]`` (positions 0..T-1) -> logits ``[T, V]`` float32."""
    eps, hyper = config.rms_norm_eps, config.hyper
    rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
    compress_rotary = RotaryEmbedding(config.compress_rope, config.max_position_embeddings)
    streams = hc.expand(F.embedding(token_ids, weights["model.embed_tokens.weight"]).float(), hyper.streams)
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        post, comb, x = hc.block_mixes(streams, weights[f"{p}.hc_attn_fn"], weights[f"{p}.hc_attn_base"],
                                       weights[f"{p}.hc_attn_scale"], hyper)
        attention = CompressedAttentionWeights.from_weights(weights, f"{p}.attn")
        out = attend_sequence(attention, config.attention, _rms(x, weights[f"{p}.attn_norm.weight"], eps),
                              window=config.sliding_windows[i], ratio=config.compress_ratios[i], rotary=rotary,
                              compress_rotary=compress_rotary, eps=eps)
        streams = hc.merge(streams, out, post, comb)
        post, comb, x = hc.block_mixes(streams, weights[f"{p}.hc_ffn_fn"], weights[f"{p}.hc_ffn_base"],
                                       weights[f"{p}.hc_ffn_scale"], hyper)
        out = _moe(config, weights, experts, i, _rms(x, weights[f"{p}.ffn_norm.weight"], eps), token_ids)
        streams = hc.merge(streams, out, post, comb)
    final = hc.head_collapse(streams, weights["model.hc_head.hc_fn"], weights["model.hc_head.hc_base"],
                             weights["model.hc_head.hc_scale"], hyper)
    return _rms(final, weights["model.norm.weight"], eps) @ weights["lm_head.weight"].float().t()
