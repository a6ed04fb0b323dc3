"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): which keys each query attends.

Shapes: B rows, T new tokens, Q q_lora_rank, Hi indexer heads, Dx indexer head dim, K ``index_topk``, n new
tokens of one sequence, L its keys.

Each token leaves one indexer key in the paged KV cache (entry ``index_k``, beside MLA's latent, so prefix
reuse and the block pool treat it like any other entry): k = rope(LayerNorm(W_k x)) [Dx]. A query at p scores
every key it sees,

    I(p, j) = sum_h w_h(p) * relu(q_h(p) . k_j / sqrt(Dx)),   q(p) = rope(W_q q_resid(p)),  w(p) = W_w x_p / sqrt(Hi)

and attends only its K best keys; while it sees no more than K keys it attends all of them (the model's own
dense fallback: transformers' top-k over a row of at most K visible keys keeps every one). The rotary part is
the first R dims of each head, rotated as halves (V3.2) or as pairs (GLM-5), with the model's cos/sin.

The scores of a query tile are computed a chunk of keys at a time and merged into a running top-K, so the
largest tensors are a chunk's [tile x Hi x chunk] products and the [tile x (K + chunk)] candidates: nothing
grows with L beyond the K kept. Float32 throughout (as transformers scores).

``select`` returns, per sequence, None (no query sees more than K keys: attention is dense) or the key
positions [n, K] of each query; rows of queries that see at most K keys hold 0..K-1, whose future positions
the attention's causal mask drops.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moed.layers.layer_config import AttentionConfig
from moed.layers.linear import linear
from moed.layers.rotary import rotate

QUERY_TILE = 256  # queries whose top-K is merged together
KEY_CHUNK = 4096  # keys scored between two merges into the running top-K
SCORE_FLOATS = 1 << 22  # the [tile x Hi x keys] products computed at once stay under this many floats
LAYER_NORM_EPS = 1e-6  # the indexer's key LayerNorm (fixed in the reference, not in config.json)

# read_keys(seq, j0, j1) -> the indexer keys j0..j1-1 of that sequence, [j1 - j0, Dx] float32
ReadKeys = Callable[[int, int, int], torch.Tensor]


class LightningIndexer:
    def __init__(self, cfg: AttentionConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.cfg = cfg
        get = lambda name: weights[f"{prefix}.{name}"]  # noqa: E731
        self.wq_b, self.wk, self.weights_proj = get("wq_b.weight"), get("wk.weight"), get("weights_proj.weight")
        self.k_norm, self.k_norm_bias = get("k_norm.weight"), get("k_norm.bias")
        self.heads, self.dim, self.topk = cfg.index_num_heads, cfg.index_head_dim, cfg.index_topk

    @staticmethod
    def cache_entries_for(cfg: AttentionConfig) -> dict[str, tuple[int, ...]]:
        return {"index_k": (cfg.index_head_dim,)}

    def keys(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, T, D] -> the new tokens' indexer keys [B, T, Dx] (what the cache keeps)."""
        k = F.layer_norm(linear(x, self.wk).float(), (self.dim,), self.k_norm.float(), self.k_norm_bias.float(),
                         LAYER_NORM_EPS)
        return self._rope(k[:, None], cos_sin)[:, 0]

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> queries [B, T, Hi, Dx] and head weights [B, T, Hi] (scaled by 1 / sqrt(Hi)), float32."""
        bsz, steps, _ = x.shape
        q = linear(q_resid, self.wq_b).float().view(bsz, steps, self.heads, self.dim).transpose(1, 2)
        q = self._rope(q, cos_sin).transpose(1, 2)
        w = linear(x.to(self.weights_proj.dtype), self.weights_proj).float() * self.heads ** -0.5
        return q, w

    def _rope(self, t: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """t [B, H, T, Dx]: its first R dims rotated."""
        r = self.cfg.qk_rope_head_dim
        rot = rotate(t[..., :r], cos_sin[0].float(), cos_sin[1].float(), interleaved=self.cfg.index_rope_interleaved)
        return torch.cat([rot, t[..., r:]], dim=-1)

    def select(self, q: torch.Tensor, w: torch.Tensor, read_keys: ReadKeys, seq: int, start: int) -> torch.Tensor | None:
        """One sequence's queries q [n, Hi, Dx] / weights w [n, Hi] at positions start..start+n-1 -> None (every
        query sees at most K keys) or the key positions [n, K] each attends."""
        n, topk = q.shape[0], self.topk
        if start + n <= topk:
            return None
        chosen = torch.arange(topk, device=q.device).expand(n, topk).clone()
        first = max(0, topk - start)  # the first query that sees more than K keys (start + i + 1 > K)
        for a in range(first, n, QUERY_TILE):
            b = min(n, a + QUERY_TILE)
            chosen[a:b] = self._tile_topk(q[a:b], w[a:b], read_keys, seq, start + a)
        return chosen

    def _tile_topk(self, q: torch.Tensor, w: torch.Tensor, read_keys: ReadKeys, seq: int, first: int) -> torch.Tensor:
        """Top-K keys of m queries at positions first..first+m-1 (each sees more than K keys) -> [m, K]."""
        m = q.shape[0]
        end = first + m  # keys 0..end-1 are visible to the tile's last query
        positions = torch.arange(first, end, device=q.device)[:, None]
        best_scores = best_keys = None
        step = max(64, SCORE_FLOATS // (m * self.heads))
        flat_q = q.reshape(m * self.heads, self.dim)
        for c0 in range(0, end, KEY_CHUNK):
            c1 = min(end, c0 + KEY_CHUNK)
            parts = []
            for j0 in range(c0, c1, step):
                j1 = min(c1, j0 + step)
                keys = read_keys(seq, j0, j1).float()  # [kb, Dx]
                scores = F.relu(torch.matmul(flat_q, keys.t()) * self.dim ** -0.5).view(m, self.heads, j1 - j0)
                parts.append(torch.matmul(w[:, None, :], scores)[:, 0])  # [m, kb]
            scores = torch.cat(parts, dim=1)
            ids = torch.arange(c0, c1, device=q.device)[None, :]
            if c1 - 1 > first:  # keys after some query's position: not visible to it
                scores = scores.masked_fill(ids > positions, float("-inf"))
            ids = ids.expand(m, -1)
            if best_scores is not None:
                scores, ids = torch.cat([best_scores, scores], dim=1), torch.cat([best_keys, ids], dim=1)
            top = scores.topk(min(self.topk, scores.shape[1]), dim=1)
            best_scores, best_keys = top.values, ids.gather(1, top.indices)
        return best_keys


def selection_mask(chosen: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
    """chosen [n, K] key positions -> [n, j1 - j0] bool: which keys j0..j1-1 each query attends."""
    width = j1 - j0
    idx = chosen - j0
    idx = torch.where((idx >= 0) & (idx < width), idx, torch.full_like(idx, width))  # elsewhere: a spare column
    mask = torch.zeros(chosen.shape[0], width + 1, dtype=torch.bool, device=chosen.device)
    return mask.scatter_(1, idx, True)[:, :width]


__all__ = ["LightningIndexer", "selection_mask"]
