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

SCORE_BUDGET = 1 << 24  # score-matrix elements a chunk of queries may build (64 MB of float32)
_POOL = ("m", "s", "a")  # an open window's online softmax per channel: running max, sum of weights, weighted sum


def _pool_names(kind: str, overlap: bool) -> tuple[str, ...]:
    parts = ("cur", "next") if overlap else ("cur",)
    return tuple(f"{kind}_{part}_{v}" for part in parts for v in _POOL)


def _pools(kv: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax pools ``(m, s, a)`` ``[W, c]`` of windows ``kv, gate [W, r, c]`` (a -inf gate is no slot; a
    window without slots is the empty pool m = s = a = 0, as a zeroed state slot)."""
    m = gate.amax(dim=1)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(gate - m[:, None])
    return m, e.sum(dim=1), (e * kv).sum(dim=1)


def _merge(p: tuple[torch.Tensor, ...], q: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pool of the union of two pools' slots (either may be empty: s = 0)."""
    (pm, ps, pa), (qm, qs, qa) = p, q
    full_p, full_q = ps > 0, qs > 0
    m = torch.where(full_p & full_q, torch.maximum(pm, qm), torch.where(full_p, pm, qm))
    kp = torch.where(full_p, torch.exp(torch.where(full_p, pm - m, torch.zeros_like(m))), torch.zeros_like(m))
    kq = torch.where(full_q, torch.exp(torch.where(full_q, qm - m, torch.zeros_like(m))), torch.zeros_like(m))
    return torch.where(full_p | full_q, m, torch.zeros_like(m)), ps * kp + qs * kq, pa * kp + qa * kq


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
        """Feed one sequence's new tokens to a compressor: every window they touch is pooled at once (with the open
        pools of the state slot for the first window, and for CSA the next entry's), each window that closes is
        written into ``entry``, and what stays open goes back into the state slot."""
        from moed.layers.kv_compressor import finish, project

        r, hd = cw.ratio, cw.head_dim
        state = {n: cache.state(self.layer, n)[slot] for n in _pool_names(kind, cw.overlap)}
        n = hidden.shape[0]
        kv, gate = project(cw, hidden)
        gate = gate + cw.position_bias.float()[(torch.arange(n) + start) % r]
        base = start - start % r  # the first window's first position
        windows = -(-(start + n - base) // r)
        closed = (start + n - base) // r
        width = kv.shape[1]
        slots_kv = torch.zeros(windows * r, width)
        slots_gate = torch.full((windows * r, width), float("-inf"))
        slots_kv[start - base:start - base + n], slots_gate[start - base:start - base + n] = kv, gate
        slots_kv, slots_gate = slots_kv.view(windows, r, width), slots_gate.view(windows, r, width)
        cur = tuple(state[f"{kind}_cur_{v}"] for v in _POOL)
        if cw.overlap:  # window j's entry: window j-1's first halves and window j's second halves
            own = _pools(slots_kv[..., hd:], slots_gate[..., hd:])
            firsts = _pools(slots_kv[..., :hd], slots_gate[..., :hd])
            nxt = tuple(state[f"{kind}_next_{v}"] for v in _POOL)
            firsts = tuple(torch.cat([_merge(tuple(t[:1] for t in firsts), tuple(t[None] for t in nxt))[i],
                                      firsts[i][1:]]) for i in range(3))
            entries = _merge(own, tuple(torch.cat([cur[i][None], firsts[i][:-1]]) for i in range(3)))
        else:
            own = _pools(slots_kv, slots_gate)
            entries = tuple(torch.cat([_merge(tuple(t[:1] for t in own), tuple(t[None] for t in cur))[i], own[i][1:]])
                            for i in range(3))
        if closed:
            _, s, a = (t[:closed] for t in entries)
            values = finish(cw, a / s, base + torch.arange(closed) * r, self.compress_rotary, self.eps)
            cache.write_positions(self.layer, entry, values.reshape(closed * r, hd // r), batch, row,
                                  torch.arange(base, base + closed * r))
        empty = tuple(torch.zeros_like(t) for t in cur)
        if cw.overlap:
            open_cur, open_next = ((tuple(t[-1] for t in entries), tuple(t[-1] for t in firsts)) if closed < windows
                                   else (tuple(t[-1] for t in firsts), empty))
            for v, c, x in zip(_POOL, open_cur, open_next):
                state[f"{kind}_cur_{v}"].copy_(c)
                state[f"{kind}_next_{v}"].copy_(x)
        else:
            open_cur = tuple(t[-1] for t in entries) if closed < windows else empty
            for v, c in zip(_POOL, open_cur):
                state[f"{kind}_cur_{v}"].copy_(c)

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
        """One sequence's ``n`` new queries, a chunk of queries at a time so that no score matrix grows with the
        context: each query scores its window's keys and the compressed entries it sees (a CSA layer's indexer
        picks ``index_topk`` of them, gathered; an HCA layer's are all its closed windows, 1/128 of the context)."""
        att, w, r = self.att, self.w, self.ratio
        heads, hd = att.num_heads, att.head_dim
        j0 = max(0, start - self.window + 1)
        keys = cache.read_range(self.layer, "kv", batch, seq, j0, start + n, torch.float32)
        closed_total = (start + n) // r if r else 0
        entries = idx = None
        if closed_total:
            entries = cache.read_range(self.layer, "ckv", batch, seq, 0, closed_total * r, torch.float32)
            entries = entries.reshape(closed_total, hd)
            if w.indexer is not None:
                idx = cache.read_range(self.layer, "cidx", batch, seq, 0, closed_total * r, torch.float32)
                idx = idx.reshape(closed_total, -1)
        seen = min(att.index_topk, closed_total) if idx is not None else closed_total
        per_query = max(heads * (2 * self.window + seen + 1),
                        att.index_num_heads * closed_total if idx is not None else 0)
        step = max(1, min(n, SCORE_BUDGET // max(per_query, 1)))
        out = torch.empty(n, heads, hd)
        sinks = w.sinks.float().view(heads, 1, 1)
        for q0 in range(0, n, step):
            q1 = min(n, q0 + step)
            qc = q[q0:q1]
            pos = torch.arange(start + q0, start + q1)
            k0 = max(0, start + q0 - self.window + 1)
            near = keys[k0 - j0:start + q1 - j0]
            diff = pos.view(-1, 1) - torch.arange(k0, start + q1).view(1, -1)
            bias = torch.where((diff >= 0) & (diff < self.window), 0.0, float("-inf"))
            parts = [torch.einsum("thd,kd->htk", qc, near) * att.scaling + bias]
            picked = None
            if closed_total:
                closed = (pos + 1) // r
                if idx is not None:
                    chosen = self._index(w.indexer, q_residual[q0:q1], hidden[q0:q1], idx, pos, closed)  # [c, k]
                    picked = entries[chosen.clamp(min=0)]  # [c, k, hd]
                    mask = torch.where(chosen >= 0, 0.0, float("-inf"))
                    parts.append(torch.einsum("thd,tkd->htk", qc, picked) * att.scaling + mask)
                else:
                    mask = torch.where(torch.arange(closed_total).view(1, -1) < closed.view(-1, 1), 0.0, float("-inf"))
                    parts.append(torch.einsum("thd,kd->htk", qc, entries) * att.scaling + mask)
            parts.append(sinks.expand(heads, q1 - q0, 1))
            probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
            o = torch.einsum("htk,kd->thd", probs[..., :near.shape[0]], near)
            if closed_total:
                far = probs[..., near.shape[0]:-1]
                o = o + (torch.einsum("htk,tkd->thd", far, picked) if picked is not None
                         else torch.einsum("htk,kd->thd", far, entries))
            out[q0:q1] = o
        o = rope_pairs(out, cos[:, None], -sin[:, None])
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
