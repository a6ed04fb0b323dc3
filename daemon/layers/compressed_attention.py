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
from moed.layers.linear import linear
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


# --------------------------------------------------------------------------- on the paged cache

_POOL = ("m", "s", "a")  # an open window's online softmax per channel: running max, sum of weights, weighted sum


def _pool_names(kind: str, overlap: bool) -> tuple[str, ...]:
    parts = ("cur", "next") if overlap else ("cur",)
    return tuple(f"{kind}_{part}_{v}" for part in parts for v in _POOL)


def _pool_add(state: dict[str, torch.Tensor], prefix: str, kv: torch.Tensor, gate: torch.Tensor) -> None:
    """Add one slot to an open pool (``{prefix}_m/_s/_a``, in place); an all-zero pool (s = 0) is empty, so a
    zeroed state slot starts a sequence."""
    m, s, a = (state[f"{prefix}_{v}"] for v in _POOL)
    old_m = torch.where(s > 0, m, gate)
    new_m = torch.maximum(old_m, gate)
    keep, new = torch.exp(old_m - new_m), torch.exp(gate - new_m)
    s.mul_(keep).add_(new)
    a.mul_(keep).add_(new * kv)
    m.copy_(new_m)


def _pool_take(state: dict[str, torch.Tensor], overlap: bool, kind: str) -> torch.Tensor:
    """The closing window's pooled value; the next entry's pool (CSA) becomes the open one, the other empties."""
    value = state[f"{kind}_cur_a"] / state[f"{kind}_cur_s"]
    for v in _POOL:
        if overlap:
            state[f"{kind}_cur_{v}"].copy_(state[f"{kind}_next_{v}"])
            state[f"{kind}_next_{v}"].zero_()
        else:
            state[f"{kind}_cur_{v}"].zero_()
    return value


class CompressedAttention:
    """One DeepSeek-V4 attention layer on the paged cache (docs/design.md, DeepSeek-V4): the shared K=V row of each
    token (``kv``), each compressed entry sliced over its window's slots (``ckv``, head_dim / r a token; ``cidx``
    for a CSA layer's indexer), and each sequence's open windows in its state slot. A step of any number of new
    tokens per sequence gives ``attend_sequence``'s outputs for those positions (tested)."""

    def __init__(self, att: AttentionConfig, weights: CompressedAttentionWeights, layer: int, *, ratio: int,
                 window: int, rotary: RotaryEmbedding, compress_rotary: RotaryEmbedding, eps: float) -> None:
        self.att, self.w, self.layer, self.ratio, self.window, self.eps = att, weights, layer, ratio, window, eps
        self.rotary, self.compress_rotary = rotary, compress_rotary

    def cache_entries(self) -> dict[str, tuple[int, ...]]:
        from moed.layers.kv_compressor import cache_entries_for

        return cache_entries_for(self.att, self.ratio, self.w.indexer is not None)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Float32 per-sequence state: the open windows' pools (nothing on a sliding layer)."""
        if not self.ratio:
            return {}
        shapes = {n: (self.att.head_dim,) for n in _pool_names("c", self.w.compressor.overlap)}
        if self.w.indexer is not None:
            shapes.update({n: (self.att.index_head_dim,) for n in _pool_names("i", True)})
        return shapes

    def _compress_into(self, cache, batch, row: int, slot: int, kind: str, cw: CompressorWeights, entry: str,
                       hidden: torch.Tensor, start: int) -> None:
        """Feed one sequence's new tokens to a compressor; write every entry whose window closes into ``entry``."""
        from moed.layers.kv_compressor import finish, project

        r, hd = cw.ratio, cw.head_dim
        state = {n: cache.state(self.layer, n)[slot] for n in _pool_names(kind, cw.overlap)}
        kv, gate = project(cw, hidden)
        gate = gate + cw.position_bias.float()[(torch.arange(hidden.shape[0]) + start) % r]
        for t in range(hidden.shape[0]):
            if cw.overlap:  # the token's second half joins its own window's entry, its first half the next one's
                _pool_add(state, f"{kind}_cur", kv[t, hd:], gate[t, hd:])
                _pool_add(state, f"{kind}_next", kv[t, :hd], gate[t, :hd])
            else:
                _pool_add(state, f"{kind}_cur", kv[t], gate[t])
            pos = start + t
            if pos % r == r - 1:
                first = pos - r + 1
                value = finish(cw, _pool_take(state, cw.overlap, kind).view(1, -1), torch.tensor([first]),
                               self.compress_rotary, self.eps)[0]
                cache.write_positions(self.layer, entry, value.view(r, hd // r), batch, row,
                                      torch.arange(first, first + r))

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """``x [R, T, D]`` (the layer's normed input, padded or packed as ``batch``) -> ``[R, T, D]`` float32."""
        att, w = self.att, self.w
        rows, steps, _ = x.shape
        heads, hd = att.num_heads, att.head_dim
        h = x.float()
        q_residual = _rms(linear(h, w.wq_a), self.eps, w.q_norm)
        q = _rms(linear(q_residual, w.wq_b).view(rows, steps, heads, hd), self.eps)
        kv = _rms(linear(h, w.wkv), self.eps, w.kv_norm)
        rot = self.compress_rotary if self.ratio else self.rotary
        cos, sin = rot.cos_sin(batch.positions)  # [R, T, R/2]
        q = rope_pairs(q, cos[:, :, None], sin[:, :, None])
        kv = rope_pairs(kv, cos, sin)
        cache.write(self.layer, "kv", kv, batch)
        out = torch.zeros(rows, steps, x.shape[-1])
        slots = cache.state_slots(batch) if self.ratio else None
        for seq in range(len(batch.starts)):
            row, off, start, n = batch.segment(seq)
            if not n:
                continue
            part = slice(off, off + n)
            if self.ratio and start == 0:  # a new sequence: its slot's windows start empty
                for t in cache.states[self.layer].values():
                    t[slots[seq]].zero_()
            if self.ratio:
                self._compress_into(cache, batch, seq, slots[seq], "c", w.compressor, "ckv", h[row, part], start)
                if w.indexer is not None:
                    self._compress_into(cache, batch, seq, slots[seq], "i", w.indexer.compressor, "cidx",
                                        h[row, part], start)
            out[row, part] = self._attend(q[row, part], q_residual[row, part], h[row, part], cos[row, part],
                                          sin[row, part], cache, batch, seq, start, n)
        return out

    def _attend(self, q, q_residual, hidden, cos, sin, cache, batch, seq: int, start: int, n: int) -> torch.Tensor:
        att, w, r = self.att, self.w, self.ratio
        heads, hd = att.num_heads, att.head_dim
        pos = torch.arange(start, start + n)
        j0 = max(0, start - self.window + 1)
        keys = cache.read_range(self.layer, "kv", batch, seq, j0, start + n, torch.float32)
        kpos = torch.arange(j0, start + n)
        diff = pos.view(-1, 1) - kpos.view(1, -1)
        bias = torch.where((diff >= 0) & (diff < self.window), 0.0, float("-inf"))
        closed_total = (start + n) // r if r else 0
        if closed_total:
            entries = cache.read_range(self.layer, "ckv", batch, seq, 0, closed_total * r, torch.float32)
            entries = entries.reshape(closed_total, hd)
            closed = (pos + 1) // r
            if w.indexer is not None:
                idx = cache.read_range(self.layer, "cidx", batch, seq, 0, closed_total * r, torch.float32)
                chosen = self._index(w.indexer, q_residual, hidden, idx.reshape(closed_total, -1), pos, closed)
                extra = torch.full((n, closed_total + 1), float("-inf"))
                extra.scatter_(1, torch.where(chosen >= 0, chosen, closed_total), 0.0)
                extra = extra[:, :-1]
            else:
                extra = torch.where(torch.arange(closed_total).view(1, -1) < closed.view(-1, 1), 0.0, float("-inf"))
            keys = torch.cat([keys, entries], dim=0)
            bias = torch.cat([bias, extra], dim=1)
        scores = torch.einsum("thd,kd->htk", q, keys) * att.scaling + bias
        sinks = w.sinks.float().view(heads, 1, 1).expand(heads, n, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        o = torch.einsum("htk,kd->thd", probs, keys)
        o = rope_pairs(o, cos[:, None], -sin[:, None])
        grouped = o.reshape(n, att.o_groups, -1)
        wo_a = w.wo_a.float().view(att.o_groups, att.o_lora_rank, -1)
        return linear(torch.einsum("tgi,gri->tgr", grouped, wo_a).reshape(n, -1), w.wo_b)

    def _index(self, iw: IndexerWeights, q_residual, hidden, entries, pos, closed) -> torch.Tensor:
        """The indexer's top-k entries for each query (``index_topk``'s rule, closed windows only; -1 past them)."""
        att = self.att
        heads, ihd = att.index_num_heads, att.index_head_dim
        n = q_residual.shape[0]
        q = linear(q_residual.float(), iw.wq_b).view(n, heads, ihd)
        cos, sin = self.compress_rotary.cos_sin(pos.view(1, -1))
        q = rope_pairs(q, cos[0][:, None], sin[0][:, None])
        scores = torch.relu(torch.einsum("thd,wd->thw", q, entries)) * ihd ** -0.5
        weights = (hidden.float() @ iw.weights_proj.float().t()) * heads ** -0.5
        scores = (scores * weights[..., None]).sum(dim=1)
        future = torch.arange(entries.shape[0]).view(1, -1) >= closed.view(-1, 1)
        k = min(att.index_topk, entries.shape[0])
        chosen = scores.masked_fill(future, float("-inf")).topk(k, dim=-1).indices
        return torch.where(chosen >= closed.view(-1, 1), torch.full_like(chosen, -1), chosen)
