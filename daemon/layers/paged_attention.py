"""Attention over the paged KV pool without score matrices: key blocks merged by their log-sum-exp.

Shapes: H query heads, Hk key/value heads, n new tokens of one sequence (queries at positions
s..s+n-1), Dk / Dv key / value dims, kb keys of one block.

Each sequence of a step is attended on its own: its keys are read from the pool a block of at most
KEY_BLOCK tokens at a time (through its block table, widened to the compute dtype), and each block's
partial result (output, log-sum-exp per query) is merged into the running one, as flash attention
does across its tiles. Nothing of size n x L (or H x n x L) exists: the largest tensors are a block's
keys and its H x n x kb scores. Keys before the new tokens are visible to every query (no mask); the
new tokens' own keys form a causal square (``is_causal``, no mask tensor); a sliding window reads
only the blocks inside it (and masks the band inside a block: n x kb at most). Attention sinks
(gpt-oss) start the running log-sum-exp at the sink's logit instead of joining the scores as a column.

On the CPU each block runs torch's flash-attention kernel, which returns the log-sum-exp
(``aten::_scaled_dot_product_flash_attention_for_cpu``); a block with a window mask, and every block
on other devices, runs ``block_reference`` (explicit scores for that block only). ``attend_dense`` in
tests is the whole-matrix oracle.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moed.layers.sparse_indexer import selection_mask

KEY_BLOCK = 4096  # keys per block before the new tokens (MHA: 4096 x Hk x (Dk + Dv) floats, ~8 MB at 4 x 128)
QUERY_TILE = 1024  # new tokens attended together: their own keys form a causal square of at most this side
# where blocks run block_reference (not the CPU's flash kernel: CUDA today), the scores of one block are
# materialised: query tiles and key blocks shrink so that H x n x kb stays under this many floats
REFERENCE_SCORES = 1 << 24
FLASH_MASK_MIN = 1 << 12  # a masked block of at least this many n x kb places runs the CPU flash kernel

# read_kv(seq, j0, j1) -> (keys [Hk, j1 - j0, Dk], values [Hk, j1 - j0, Dv]) of keys j0..j1-1 of that sequence
ReadKV = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]


def block_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q [H, n, Dk], k [Hk, kb, Dk], v [Hk, kb, Dv], mask [n, kb] (True: visible) or ``causal``
    (n == kb, query i sees keys 0..i) -> (out [H, n, Dv], lse [H, n]); a query that sees no key of the block
    gets out 0 and lse -inf."""
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, n, kb]
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    probs = torch.exp(scores - top)
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, v) / total.clamp(min=torch.finfo(total.dtype).tiny)
    lse = (top + torch.log(total)).squeeze(-1)  # log(0) = -inf where nothing is visible
    return out, lse


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if k.shape[0] == 1 and q.shape[0] > 1 and not causal:
        # one KV head (MLA on its latent cache) and every key visible: the heads are just more queries of
        # that head, so the block is one [H * n, kb] product instead of H thin ones
        # the explicit product (block_reference): the block's scores are [H * n, kb] (bounded by the key
        # block), and two GEMMs beat the CPU flash kernel here (it pads v to k's width and tiles for many
        # queries per head: DeepSeek-V3 at 8k keys, float32, 2 cores: 12 vs 25 ms)
        # (a mask [n, kb] is the same for every head: repeated per head's rows)
        heads, n = q.shape[0], q.shape[1]
        out, lse = block_reference(q.reshape(1, heads * n, q.shape[-1]), k, v, scale,
                                   None if mask is None else mask.repeat(heads, 1))
        return out.reshape(heads, n, out.shape[-1]), lse.reshape(heads, n)
    if (mask is None or mask.shape[0] * mask.shape[1] >= FLASH_MASK_MIN) and q.device.type == "cpu" \
            and q.dtype == k.dtype == v.dtype:
        dim, dv = max(q.shape[-1], v.shape[-1]), v.shape[-1]
        if q.shape[-1] != dim or dv != dim:  # the kernel wants one head size (MLA: 192 for q/k, 128 for v):
            q, k, v = (F.pad(t, (0, dim - t.shape[-1])) for t in (q, k, v))  # zeros change no score
        # a mask (sliding window, sparse attention) goes in additive, [n, kb] for every head
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), 0.0, causal,
            attn_mask=None if bias is None else bias[None, None], scale=scale)
        out, lse = out[0, ..., :dv], lse[0].to(out.dtype)
        if mask is not None:  # the kernel gives a query that sees no key of the block lse 0: it must be -inf
            blind = ~mask.any(dim=1)
            if bool(blind.any()):
                lse = lse.masked_fill(blind[None], float("-inf"))
                out = out.masked_fill(blind[None, :, None], 0.0)
        return out, lse
    return block_reference(q, k, v, scale, mask, causal)


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint key sets -> the result over both (``out`` updated in place)."""
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w_old = torch.where(torch.isfinite(lse), torch.exp(lse - safe), torch.zeros_like(lse))
    w_new = torch.where(torch.isfinite(part_lse), torch.exp(part_lse - safe), torch.zeros_like(part_lse))
    out.mul_(w_old[..., None].to(out.dtype)).add_(part * w_new[..., None].to(part.dtype))
    return out, new


def attend_row(q: torch.Tensor, read_kv: ReadKV, row: int, start: int, scale: float, *, window: int | None = None,
               sinks: torch.Tensor | None = None, value_dim: int | None = None,
               key_block: int | None = None, chosen: torch.Tensor | None = None,
               chunk: int | None = None) -> torch.Tensor:
    """q [H, n, Dk] of one sequence whose first new token is at position ``start`` (its keys 0..start+n-1 are
    in the pool, the new ones included) -> [H, n, Dv]. ``chosen`` [n, K]: the only key positions each query
    may attend (sparse attention; still causal). ``chunk`` (Llama-4's chunked local attention): the query at p
    sees only keys of its own chunk, p - p % chunk <= j <= p."""
    heads, n = q.shape[0], q.shape[1]
    end = start + n
    lo = 0 if window is None else max(0, start - window + 1)
    if chunk is not None:
        lo = max(lo, start - start % chunk)
    out = lse = positions = None
    key_block = key_block or KEY_BLOCK
    j0 = lo
    while j0 < end:
        # the keys before the new tokens in blocks, then the new tokens' own keys: a causal square; one new token
        # (decode) sees its own key as it sees the earlier ones, so its blocks run to the end unmasked (at a
        # short context: one block, no merge)
        if n == 1:
            j1, causal = min(end, j0 + key_block), False
        else:
            j1, causal = (min(start, j0 + key_block), False) if j0 < start else (end, True)
        k, v = read_kv(row, j0, j1)
        mask = None
        if window is not None or chunk is not None:  # key j is visible to the query at p iff lowest(p) <= j <= p
            if positions is None:
                positions = torch.arange(start, end, device=q.device)[:, None]
            keys = torch.arange(j0, j1, device=q.device)[None, :]
            mask, causal = keys <= positions, False
            if window is not None:  # p - window < j
                mask &= keys > positions - window
            if chunk is not None:  # p - p % chunk <= j
                mask &= keys >= positions - positions % chunk
        if chosen is not None:
            picked = selection_mask(chosen, j0, j1)
            if causal:  # the new tokens' own keys: query i sees keys 0..i of the square
                picked &= torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            mask, causal = picked if mask is None else mask & picked, False
        part, part_lse = _block(q, k, v, scale, mask, causal)
        out, lse = (part, part_lse) if out is None else _merge(out, lse, part, part_lse)
        j0 = j1
    if out is None:  # no keys at all (n == 0)
        return torch.zeros(heads, n, value_dim or q.shape[-1], dtype=q.dtype, device=q.device)
    if sinks is not None:  # the sink's logit joins every query's softmax denominator and adds no value
        sink = sinks.to(lse.dtype).reshape(heads, 1)
        keep = torch.exp(lse - torch.logaddexp(lse, sink))  # exp(-inf) = 0 where no key was visible
        out = out * keep[..., None].to(out.dtype)
    return out


def attend_paged(q: torch.Tensor, read_kv: ReadKV, starts: list[int], lengths: list[int], scale: float, *,
                 window: int | None = None, sinks: torch.Tensor | None = None, value_dim: int,
                 key_block: int | None = None, rows: list[int] | None = None,
                 offsets: list[int] | None = None, chosen: list[torch.Tensor | None] | None = None,
                 chunk: int | None = None) -> torch.Tensor:
    """q [R, H, T, Dk] -> [R, T, H * Dv], zeros where no sequence is. Sequence i has ``lengths[i]`` new tokens
    from position ``starts[i]`` (their keys already in the pool) at places ``offsets[i]..`` of tensor row
    ``rows[i]`` (default: row i from place 0, the padded layout; ForwardBatch.segment). ``read_kv`` is called
    with the sequence's index. Each sequence's new tokens are attended in query tiles of QUERY_TILE: a tile's
    keys are everything before it (in blocks of ``key_block``, default KEY_BLOCK: callers whose blocks cost
    more per key pass less) and its own causal square. ``chosen[i]`` (sparse attention): sequence i's key
    positions per query, [n, K], or None (every key). ``chunk``: chunked local attention (``attend_row``)."""
    num_rows, heads, steps, _ = q.shape
    out = torch.zeros(num_rows, steps, heads * value_dim, dtype=q.dtype, device=q.device)
    tile, key_block = QUERY_TILE, key_block or KEY_BLOCK
    if q.device.type != "cpu":  # block_reference's scores: H x tile x tile and H x tile x key_block, bounded
        tile = max(16, min(tile, int((REFERENCE_SCORES // heads) ** 0.5) // 16 * 16))
        key_block = max(16, min(key_block, REFERENCE_SCORES // (heads * tile) // 16 * 16))
    rows = list(range(len(starts))) if rows is None else rows
    offsets = [0] * len(starts) if offsets is None else offsets
    chosen = [None] * len(starts) if chosen is None else chosen
    for seq, (row, off, start, n) in enumerate(zip(rows, offsets, starts, lengths)):
        for a in range(0, n, tile):
            b = min(n, a + tile)
            picked = None if chosen[seq] is None else chosen[seq][a:b]
            o = attend_row(q[row, :, off + a:off + b], read_kv, seq, start + a, scale, window=window, sinks=sinks,
                           value_dim=value_dim, key_block=key_block, chosen=picked, chunk=chunk)
            out[row, off + a:off + b] = o.transpose(0, 1).reshape(b - a, heads * value_dim)
    return out


def attend_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Queries q [H, n, Dk] over one gathered set of keys k [Hk, U, Dk] / values v [Hk, U, Dv], ``mask`` [n, U]
    (True: visible; None: all) -> [H, n, Dv] (sparse attention's chosen keys)."""
    return _block(q, k, v, scale, mask, False)[0]


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The whole-matrix oracle (tests): q [B, H, T, Dh], k [B, Hk, L, Dh], v [B, Hk, L, Dv], mask [B, 1, T, L]
    -> [B, T, H * Dv]. With sinks a per-head logit joins each softmax and is dropped."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


def dense_mask(starts: list[int], lengths: list[int], steps: int, num_keys: int, window: int | None,
               chunk: int | None = None) -> torch.Tensor:
    """[B, 1, T, L] bool for ``attend_dense`` (tests): key j visible to the query at p iff j <= p (and p - w < j,
    and p - p % chunk <= j)."""
    keys = torch.arange(num_keys)[None, None, :]
    pos = (torch.tensor(starts)[:, None] + torch.arange(steps)[None, :])[:, :, None]
    mask = keys <= pos
    if window is not None:
        mask &= keys > pos - window
    if chunk is not None:
        mask &= keys >= pos - pos % chunk
    return mask[:, None]


__all__ = ["KEY_BLOCK", "QUERY_TILE", "attend_keys", "attend_paged", "attend_row", "block_reference", "attend_dense", "dense_mask"]
