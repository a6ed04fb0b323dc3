"""DeepSeek multi-head latent attention (MLA); the cache holds the compressed latent, not full K/V.

Shapes: B batch, T new tokens, L keys, H heads, C kv_lora_rank, Rn nope dims, Rr rope dims, Dv value dims.
"""

from __future__ import annotations

import torch

from moed.cache.kv_cache import KVCache
from moed.layers.linear import linear
from moed.layers.packed_linear import PackedLinear
from moed.layers.layer_config import AttentionConfig
from moed.layers.norms import rms_norm
from moed.layers.paged_attention import attend_keys, attend_paged
from moed.layers.rotary import RotaryEmbedding
from moed.layers.sparse_indexer import LightningIndexer
from moed.runner.forward_batch import ForwardBatch


class MlaAttention:
    def __init__(self, cfg: AttentionConfig, weights: dict[str, torch.Tensor], prefix: str, layer: int,
                 rotary: RotaryEmbedding, window: int | None, eps: float, *, index_source: int | None = None,
                 rope: bool = True) -> None:
        """``index_source`` (sparse attention): the layer whose lightning indexer picks this layer's keys (this
        one's own ``{prefix}.indexer``, or an earlier layer's in the same step)."""
        self.cfg, self.layer, self.rotary, self.eps = cfg, layer, rotary, eps
        self.rope = rope  # False: Kimi-Linear's MLA (its "rotary" dims used as they are)
        self.index_source = index_source
        self.indexer = (LightningIndexer(cfg, weights, f"{prefix}.indexer") if index_source == layer else None)
        get = lambda name: weights.get(f"{prefix}.{name}")  # noqa: E731
        self.q_proj = get("q_proj.weight")
        self.q_a, self.q_a_bias, self.q_a_norm = get("q_a_proj.weight"), get("q_a_proj.bias"), get("q_a_layernorm.weight")
        self.q_b = get("q_b_proj.weight")
        self.kv_a, self.kv_a_bias = get("kv_a_proj_with_mqa.weight"), get("kv_a_proj_with_mqa.bias")
        self.kv_a_norm = get("kv_a_layernorm.weight")
        self.kv_b = get("kv_b_proj.weight")
        self.wo, self.bo = get("o_proj.weight"), get("o_proj.bias")
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def cache_entries_for(cfg: AttentionConfig, *, indexer: bool = False) -> dict[str, tuple[int, ...]]:
        """Per-token KV-cache entries: the compressed latent and the shared rotary key (and the lightning
        indexer's key on a layer that runs one)."""
        entries = {"latent": (cfg.kv_lora_rank,), "k_rot": (cfg.qk_rope_head_dim,)}
        return {**entries, **LightningIndexer.cache_entries_for(cfg)} if indexer else entries

    def cache_entries(self) -> dict[str, tuple[int, ...]]:
        return self.cache_entries_for(self.cfg, indexer=self.indexer is not None)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        bsz, steps, _ = x.shape
        q_resid = None
        if self.q_a is None:
            q = linear(x, self.q_proj)
        else:
            q_resid = rms_norm(linear(x, self.q_a, self.q_a_bias), self.q_a_norm, self.eps)
            q = linear(q_resid, self.q_b)
        q = q.view(bsz, steps, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim).transpose(1, 2)
        q_pass, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)  # [B, H, T, *]
        compressed = linear(x, self.kv_a, self.kv_a_bias)
        latent, k_rot = compressed.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.kv_a_norm, self.cfg.latent_norm_eps or self.eps)  # [B, T, C]
        if self.rope:
            q_rot = self.rotary.apply(q_rot, *cos_sin)
            k_rot = self.rotary.apply(k_rot[:, None], *cos_sin)[:, 0]  # [B, T, Rr], shared by all heads
        cache.write(self.layer, "latent", latent, batch)
        cache.write(self.layer, "k_rot", k_rot, batch)
        chosen = None if self.index_source is None else self._choose(x, q_resid, batch, cache, cos_sin)
        # each sequence with a few new tokens (decode) attends the latent cache itself; longer ones (prefill)
        # expand it through kv_b, where that is the faster form
        absorb = not isinstance(self.kv_b, PackedLinear)
        count = len(batch.lengths)
        short = [i for i, n in enumerate(batch.lengths) if absorb and n <= ABSORB_MAX_STEPS]
        long = [i for i in range(count) if i not in set(short)]
        out = None
        for seqs, absorbed in ((short, True), (long, False)):
            if not seqs:
                continue
            picked = None if chosen is None else [chosen[i] for i in seqs]
            if len(seqs) == count:  # every sequence: attend in the step's own layout
                part = self._attend(q_pass, q_rot, latent.dtype, batch, cache, seqs, batch.rows, batch.offsets,
                                    absorbed, picked)
            else:  # some: their tokens gathered into one packed row, and the result put back in place
                places = _places(batch, seqs)
                lengths = [batch.lengths[i] for i in seqs]
                offsets = [sum(lengths[:j]) for j in range(len(seqs))]
                sub = self._attend(_take(q_pass, places), _take(q_rot, places), latent.dtype, batch, cache, seqs,
                                   [0] * len(seqs), offsets, absorbed, picked)
                part = torch.zeros(bsz * steps, sub.shape[-1], dtype=sub.dtype, device=sub.device)
                part[places] = sub[0]
                part = part.view(bsz, steps, -1)
            out = part if out is None else out + part
        return linear(out, self.wo, self.bo)

    def _choose(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor | None]:
        """Sparse attention: each sequence's key positions per query (LightningIndexer.select), from this layer's
        indexer (its keys cached first), or the ones its source layer chose earlier in this step."""
        # only the latest indexer layer's choice is kept for the step (a shared layer reuses the indexer layer
        # nearest before it): one [n, K] per sequence, not one per layer
        if self.indexer is None:
            source, chosen = batch.memo["dsa_chosen"]
            assert source == self.index_source, (source, self.index_source)
            return chosen
        indexer = self.indexer
        cache.write(self.layer, "index_k", indexer.keys(x, cos_sin), batch)
        q, w = indexer.queries(x, q_resid, cos_sin)

        def read_keys(seq: int, j0: int, j1: int) -> torch.Tensor:
            return cache.read_range(self.layer, "index_k", batch, seq, j0, j1, torch.float32)

        chosen = []
        for seq in range(len(batch.lengths)):
            row, off, start, n = batch.segment(seq)
            chosen.append(indexer.select(q[row, off:off + n], w[row, off:off + n], read_keys, seq, start))
        batch.memo["dsa_chosen"] = (self.layer, chosen)
        return chosen

    def _attend(self, q_pass: torch.Tensor, q_rot: torch.Tensor, dtype: torch.dtype, batch: ForwardBatch,
                cache: KVCache, seqs: list[int], rows: list[int], offsets: list[int], absorbed: bool,
                chosen: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Attention of the sequences ``seqs`` of the step, whose queries ``q_pass / q_rot [R, H, T, *]`` are at
        ``rows`` / ``offsets`` -> ``[R, T, H * Dv]``; ``chosen``: their keys per query (sparse attention)."""
        cfg = self.cfg
        heads, nope, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        starts, lengths = [batch.starts[i] for i in seqs], [batch.lengths[i] for i in seqs]
        if absorbed:
            return self._absorbed_attention(q_pass, q_rot, dtype, batch, cache, seqs, starts, lengths, rows, offsets,
                                            chosen)

        def read_kv(local: int, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor]:
            # one block of the sequence's latent cache expanded through kv_b: keys [H, kb, Rn + Rr], values [H, kb, Dv]
            lat = cache.read_range(self.layer, "latent", batch, seqs[local], j0, j1, dtype)  # [kb, C]
            rot = cache.read_range(self.layer, "k_rot", batch, seqs[local], j0, j1, q_rot.dtype)  # [kb, Rr]
            kv = linear(lat, self.kv_b).view(j1 - j0, heads, nope + dv).transpose(0, 1)
            k_nope, values = kv.split([nope, dv], dim=-1)
            return torch.cat([k_nope, rot[None].expand(heads, -1, -1)], dim=-1), values

        query = torch.cat([q_pass, q_rot], dim=-1)  # [R, H, T, Rn + Rr]
        # a block of keys costs H x (Rn + Rr + Dv) floats per key once expanded: smaller blocks than MHA's
        return attend_paged(query, read_kv, starts, lengths, cfg.scaling, value_dim=dv, key_block=MLA_KEY_BLOCK,
                            rows=rows, offsets=offsets, chosen=chosen)

    def _absorbed_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b split per head into W_uk [H, Rn, C] and W_uv [H, Dv, C] (views of the weight when it already
        has ``dtype``; else one converted copy, kept)."""
        cfg = self.cfg
        if self._absorbed is None or self._absorbed[0].dtype != dtype:
            w = self.kv_b.to(dtype).view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            self._absorbed = (w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:])
        return self._absorbed

    def _absorbed_attention(self, q_pass: torch.Tensor, q_rot: torch.Tensor, dtype: torch.dtype, batch: ForwardBatch,
                            cache: KVCache, seqs: list[int], starts: list[int], lengths: list[int], rows: list[int],
                            offsets: list[int], chosen: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Attention on the latent cache itself (DeepSeek's "absorbed" form, for decode): the nope part of each
        query goes through W_uk into the latent space, so every key is [latent | k_rot] shared by all heads
        (one KV head) and every value the latent; the per-head output leaves through W_uv. Reads L x (C + Rr)
        per step instead of expanding L x H x (Rn + Dv) through kv_b. [R, H, T, *] -> [R, T, H * Dv]."""
        cfg = self.cfg
        bsz, heads, steps, _ = q_pass.shape
        w_uk, w_uv = self._absorbed_weights(dtype)
        q_lat = torch.einsum("bhtn,hnc->bhtc", q_pass.to(dtype), w_uk)  # [R, H, T, C]
        query = torch.cat([q_lat, q_rot.to(dtype)], dim=-1)  # [R, H, T, C + Rr]

        def read_kv(local: int, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor]:
            lat = cache.read_range(self.layer, "latent", batch, seqs[local], j0, j1, dtype)  # [kb, C]
            rot = cache.read_range(self.layer, "k_rot", batch, seqs[local], j0, j1, dtype)  # [kb, Rr]
            return torch.cat([lat, rot], dim=-1)[None], lat[None]  # one KV head

        # sparse attention: a sequence whose queries attend chosen keys reads those keys alone (K of them per
        # query, not its whole cache); the others (no query sees more than K keys) attend the pool as usual
        chosen = chosen or [None] * len(seqs)
        dense_lengths = [0 if c is not None else n for c, n in zip(chosen, lengths)]
        out_lat = attend_paged(query, read_kv, starts, dense_lengths, cfg.scaling, value_dim=cfg.kv_lora_rank,
                               rows=rows, offsets=offsets)
        for local, picked in enumerate(chosen):
            if picked is not None:
                row, off, n = rows[local], offsets[local], lengths[local]
                part = self._attend_chosen(query[row, :, off:off + n], dtype, batch, cache, seqs[local], starts[local],
                                           picked)
                out_lat[row, off:off + n] = part.transpose(0, 1).reshape(n, heads * cfg.kv_lora_rank)
        out_lat = out_lat.view(bsz, steps, heads, cfg.kv_lora_rank)
        return torch.einsum("bthc,hvc->bthv", out_lat, w_uv).reshape(bsz, steps, heads * cfg.v_head_dim)


    def _attend_chosen(self, query: torch.Tensor, dtype: torch.dtype, batch: ForwardBatch, cache: KVCache, seq: int,
                       start: int, chosen: torch.Tensor) -> torch.Tensor:
        """Absorbed attention of one sequence's n new tokens (query [H, n, C + Rr]) over the K keys each chose
        (``chosen`` [n, K]) -> [H, n, C]. The n x K positions are gathered from the pool as they are (no dedup:
        no host sync for a variable count); query i sees its own K of them, up to its position (a query that sees
        at most K keys chose 0..K-1, and the later ones are dropped)."""
        n, k = chosen.shape
        end = start + n
        flat = chosen.reshape(-1).clamp(max=end - 1)  # positions past the new tokens: read as the last, masked
        lat = cache.read_positions(self.layer, "latent", batch, seq, flat, dtype)  # [n * K, C]
        rot = cache.read_positions(self.layer, "k_rot", batch, seq, flat, dtype)  # [n * K, Rr]
        positions = torch.arange(start, end, device=chosen.device)[:, None]
        own = torch.eye(n, dtype=torch.bool, device=chosen.device).repeat_interleave(k, dim=1)  # [n, n * K]
        mask = own & (chosen.reshape(1, -1) <= positions)
        return attend_keys(query, torch.cat([lat, rot], dim=-1)[None], lat[None], self.cfg.scaling, mask)


def _places(batch: ForwardBatch, seqs: list[int]) -> torch.Tensor:
    """Flat indices into the step's [R * T] places of the sequences ``seqs``' tokens, in that order."""
    steps = batch.input_ids.shape[1]
    idx = [torch.arange(row * steps + off, row * steps + off + n)
           for row, off, _, n in (batch.segment(i) for i in seqs)]
    return batch.upload(torch.cat(idx))


def _take(q: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """[R, H, T, D] -> the given places as one packed row [1, H, N, D]."""
    rows, heads, steps, dim = q.shape
    return q.transpose(1, 2).reshape(rows * steps, heads, dim)[places].transpose(0, 1)[None]


MLA_KEY_BLOCK = 512  # keys expanded through kv_b at a time (DeepSeek-V3: 512 x 128 x 320 floats, 84 MB)
ABSORB_MAX_STEPS = 8  # new tokens per row up to which attention runs on the latent cache (decode, short steps)

