"""DeepSeek-V4's attention over one whole sequence (issue #33; paper section 2.3): the reference form moed's paged
implementation will be tested against, as ``paged_attention``'s block reference is for the others.

Per layer: a low-rank query (``wq_a``, RMSNorm ``q_norm``, ``wq_b``, then an RMSNorm without weight per head) and
one shared key/value head (``wkv``, RMSNorm ``norm``), both rotated on their trailing ``rope_dim`` channels (pairs
in place; the "main" rotary on sliding layers, the "compress" one on compressed layers). Each query attends, in one
softmax with a learned sink per head, to

- the last ``window`` rows of the shared K=V head (itself included), and
- on a compressed layer, the compressed entries of the windows that closed before it (``kv_compressor``): every one
  on a heavily compressed (HCA) layer, the lightning indexer's top ``index_topk`` on a compressed sparse (CSA) one.

The output (the same rows, K = V) is rotated back (the inverse rotary at the query's position), projected per group
of heads to ``o_lora_rank`` (``wo_a``) and mixed to the hidden size (``wo_b``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moed.layers.kv_compressor import CompressorWeights, compress, rope_pairs
from moed.layers.layer_config import AttentionConfig
from moed.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class IndexerWeights:
    """A CSA layer's lightning indexer: its query projection, head weights and own compressor."""

    wq_b: torch.Tensor  # [index_heads * index_head_dim, q_lora_rank]
    weights_proj: torch.Tensor  # [index_heads, D]
    compressor: CompressorWeights


@dataclass(frozen=True)
class CompressedAttentionWeights:
    """One layer's weights under DeepSeek's names (``attn.wq_a`` ...)."""

    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # [o_groups * o_lora_rank, heads * head_dim / o_groups]
    wo_b: torch.Tensor  # [D, o_groups * o_lora_rank]
    sinks: torch.Tensor  # [heads]
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None

    @classmethod
    def from_weights(cls, weights: dict[str, torch.Tensor], prefix: str) -> "CompressedAttentionWeights":
        """From canonical names (``{prefix}.wq_a.weight`` ...; models/weight_spec.py)."""
        def comp(p: str, overlap: bool) -> CompressorWeights:
            return CompressorWeights(weights[f"{p}.wkv.weight"], weights[f"{p}.wgate.weight"], weights[f"{p}.ape"],
                                     weights[f"{p}.norm.weight"], overlap)
        indexer = None
        if f"{prefix}.indexer.wq_b.weight" in weights:
            x = f"{prefix}.indexer"
            indexer = IndexerWeights(weights[f"{x}.wq_b.weight"], weights[f"{x}.weights_proj.weight"],
                                     comp(f"{x}.compressor", True))
        compressor = comp(f"{prefix}.compressor", indexer is not None) if f"{prefix}.compressor.ape" in weights else None
        return cls(weights[f"{prefix}.wq_a.weight"], weights[f"{prefix}.q_norm.weight"], weights[f"{prefix}.wq_b.weight"],
                   weights[f"{prefix}.wkv.weight"], weights[f"{prefix}.norm.weight"], weights[f"{prefix}.wo_a.weight"],
                   weights[f"{prefix}.wo_b.weight"], weights[f"{prefix}.attn_sink"], compressor, indexer)


def _rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else weight.float() * y


def index_topk(w: IndexerWeights, att: AttentionConfig, hidden: torch.Tensor, q_residual: torch.Tensor,
               entries: torch.Tensor, ratio: int, rotary: RotaryEmbedding) -> torch.Tensor:
    """The lightning indexer's choice: ``[T, k]`` entry indices per query (-1 where fewer than k entries had
    closed), k = min(index_topk, entries); scores sum_h w_h relu(q_h . key) over the entries of closed windows."""
    t = hidden.shape[0]
    heads, hd = att.index_num_heads, att.index_head_dim
    q = (q_residual.float() @ w.wq_b.float().t()).view(t, heads, hd)
    cos, sin = rotary.cos_sin(torch.arange(t).view(1, -1))
    q = rope_pairs(q, cos[0][:, None], sin[0][:, None])
    scores = torch.relu(torch.einsum("thd,wd->thw", q, entries.float())) * hd ** -0.5
    weights = (hidden.float() @ w.weights_proj.float().t()) * heads ** -0.5  # [T, heads]
    scores = (scores * weights[..., None]).sum(dim=1)  # [T, W]
    closed = (torch.arange(t) + 1) // ratio  # entries visible to each query
    future = torch.arange(entries.shape[0]).view(1, -1) >= closed.view(-1, 1)
    k = min(att.index_topk, entries.shape[0])
    chosen = scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
    return torch.where(chosen >= closed.view(-1, 1), torch.full_like(chosen, -1), chosen)


def attend_sequence(w: CompressedAttentionWeights, att: AttentionConfig, hidden: torch.Tensor, *, window: int,
                    ratio: int, rotary: RotaryEmbedding, compress_rotary: RotaryEmbedding, eps: float) -> torch.Tensor:
    """``hidden [T, D]`` (positions 0..T-1, the layer's normed input) -> the attention output ``[T, D]`` float32."""
    t = hidden.shape[0]
    heads, hd = att.num_heads, att.head_dim
    h = hidden.float()
    q_residual = _rms(h @ w.wq_a.float().t(), eps, w.q_norm)
    q = _rms((q_residual @ w.wq_b.float().t()).view(t, heads, hd), eps)
    kv = _rms(h @ w.wkv.float().t(), eps, w.kv_norm)  # [T, hd]
    rot = rotary if not ratio else compress_rotary
    cos, sin = rot.cos_sin(torch.arange(t).view(1, -1))
    cos, sin = cos[0], sin[0]  # [T, R/2]
    q = rope_pairs(q, cos[:, None], sin[:, None])
    kv = rope_pairs(kv, cos, sin)
    pos = torch.arange(t)
    bias = torch.where((pos.view(-1, 1) - pos.view(1, -1) >= 0) & (pos.view(-1, 1) - pos.view(1, -1) < window),
                       0.0, float("-inf"))  # [T, T] the sliding window, causal
    keys = kv
    if ratio:
        entries = compress(w.compressor, hidden, compress_rotary, eps)  # [W, hd]
        closed = (pos + 1) // ratio
        if w.indexer is not None:
            idx_entries = compress(w.indexer.compressor, hidden, compress_rotary, eps)
            chosen = index_topk(w.indexer, att, hidden, q_residual, idx_entries, ratio, compress_rotary)
            extra = torch.full((t, entries.shape[0] + 1), float("-inf"))
            extra.scatter_(1, torch.where(chosen >= 0, chosen, entries.shape[0]), 0.0)
            extra = extra[:, :-1]
        else:
            extra = torch.where(torch.arange(entries.shape[0]).view(1, -1) < closed.view(-1, 1), 0.0, float("-inf"))
        keys = torch.cat([kv, entries], dim=0)
        bias = torch.cat([bias, extra], dim=1)
    scores = torch.einsum("thd,kd->htk", q, keys) * att.scaling + bias  # [H, T, K]
    sinks = w.sinks.float().view(heads, 1, 1).expand(heads, t, 1)
    probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("htk,kd->thd", probs, keys)  # [T, H, hd]
    out = rope_pairs(out, cos[:, None], -sin[:, None])
    groups = att.o_groups
    grouped = out.reshape(t, groups, -1)  # [T, G, H hd / G]
    wo_a = w.wo_a.float().view(groups, att.o_lora_rank, -1)  # [G, r, H hd / G]
    mixed = torch.einsum("tgi,gri->tgr", grouped, wo_a).reshape(t, -1)
    return mixed @ w.wo_b.float().t()
