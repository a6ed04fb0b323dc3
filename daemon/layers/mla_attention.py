"""DeepSeek multi-head latent attention (MLA); the cache holds the compressed latent, not full K/V.

Shapes: B batch, T new tokens, L keys, H heads, C kv_lora_rank, Rn nope dims, Rr rope dims, Dv value dims.
"""

from __future__ import annotations

import torch

from moed.cache.kv_cache import KVCache
from moed.layers.linear import linear
from moed.layers.layer_config import AttentionConfig
from moed.layers.norms import rms_norm
from moed.layers.paged_attention import attend_paged
from moed.layers.rotary import RotaryEmbedding
from moed.runner.forward_batch import ForwardBatch


class MlaAttention:
    def __init__(self, cfg: AttentionConfig, weights: dict[str, torch.Tensor], prefix: str, layer: int,
                 rotary: RotaryEmbedding, window: int | None, eps: float) -> None:
        self.cfg, self.layer, self.rotary, self.eps = cfg, layer, rotary, eps
        get = lambda name: weights.get(f"{prefix}.{name}")  # noqa: E731
        self.q_proj = get("q_proj.weight")
        self.q_a, self.q_a_bias, self.q_a_norm = get("q_a_proj.weight"), get("q_a_proj.bias"), get("q_a_layernorm.weight")
        self.q_b = get("q_b_proj.weight")
        self.kv_a, self.kv_a_bias = get("kv_a_proj_with_mqa.weight"), get("kv_a_proj_with_mqa.bias")
        self.kv_a_norm = get("kv_a_layernorm.weight")
        self.kv_b = get("kv_b_proj.weight")
        self.wo, self.bo = get("o_proj.weight"), get("o_proj.bias")

    @staticmethod
    def cache_entries_for(cfg: AttentionConfig) -> dict[str, tuple[int, ...]]:
        """Per-token KV-cache entries: the compressed latent and the shared rotary key."""
        return {"latent": (cfg.kv_lora_rank,), "k_rot": (cfg.qk_rope_head_dim,)}

    def cache_entries(self) -> dict[str, tuple[int, ...]]:
        return self.cache_entries_for(self.cfg)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        bsz, steps, _ = x.shape
        if self.q_a is None:
            q = linear(x, self.q_proj)
        else:
            q = linear(rms_norm(linear(x, self.q_a, self.q_a_bias), self.q_a_norm, self.eps), self.q_b)
        q = q.view(bsz, steps, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim).transpose(1, 2)
        q_pass, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)  # [B, H, T, *]
        compressed = linear(x, self.kv_a, self.kv_a_bias)
        latent, k_rot = compressed.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.kv_a_norm, self.eps)  # [B, T, C]
        q_rot = self.rotary.apply(q_rot, *cos_sin)
        k_rot = self.rotary.apply(k_rot[:, None], *cos_sin)[:, 0]  # [B, T, Rr], shared by all heads
        cache.write(self.layer, "latent", latent, batch)
        cache.write(self.layer, "k_rot", k_rot, batch)
        heads, nope, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim

        def read_kv(row: int, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor]:
            # one block of the row's latent cache expanded through kv_b: keys [H, kb, Rn + Rr], values [H, kb, Dv]
            lat = cache.read_range(self.layer, "latent", batch, row, j0, j1, latent.dtype)  # [kb, C]
            rot = cache.read_range(self.layer, "k_rot", batch, row, j0, j1, k_rot.dtype)  # [kb, Rr]
            kv = linear(lat, self.kv_b).view(j1 - j0, heads, nope + dv).transpose(0, 1)
            k_nope, values = kv.split([nope, dv], dim=-1)
            return torch.cat([k_nope, rot[None].expand(heads, -1, -1)], dim=-1), values

        query = torch.cat([q_pass, q_rot], dim=-1)  # [B, H, T, Rn + Rr]
        out = attend_paged(query, read_kv, batch.starts, batch.lengths, cfg.scaling, value_dim=dv)
        return linear(out, self.wo, self.bo)
