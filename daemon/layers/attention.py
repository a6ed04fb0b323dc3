"""Multi-head attention with grouped KV heads, optional q/k norms, clipping and attention sinks.

Shapes: B batch, T new tokens, L visible keys, H query heads, Hk key/value heads, Dh head dim.
Decode on the CPU runs the native kernel; every other step attends the paged pool block by block
(layers/paged_attention.py): no T x L score or mask tensor.
"""

from __future__ import annotations

import torch

from moed.cache.kv_cache import KVCache
from moed.kernels.native_cpu import native
from moed.layers.layer_config import AttentionConfig
from moed.layers.linear import linear, linear_many
from moed.layers.norms import rms_norm
from moed.layers.paged_attention import attend_paged
from moed.layers.rotary import RotaryEmbedding
from moed.runner.forward_batch import ForwardBatch


class MhaAttention:
    """Standard attention layer (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, MiniMax-M2, Llama-4)."""

    def __init__(self, cfg: AttentionConfig, weights: dict[str, torch.Tensor], prefix: str, layer: int,
                 rotary: RotaryEmbedding, window: int | None, eps: float, *, chunk: int | None = None,
                 rope: bool = True) -> None:
        """``chunk``: chunked local attention (Llama-4); ``rope`` False: a NoPE layer (no rotation, no weightless
        q/k norm, the query temperature of ``cfg.nope_temperature``)."""
        self.cfg, self.layer, self.rotary, self.window, self.eps = cfg, layer, rotary, window, eps
        self.chunk, self.rope = chunk, rope
        get = lambda name: weights.get(f"{prefix}.{name}")  # noqa: E731
        self.wq, self.wk, self.wv, self.wo = (get(f"{p}_proj.weight") for p in "qkvo")
        self.bq, self.bk, self.bv, self.bo = (get(f"{p}_proj.bias") for p in "qkvo")
        self.q_norm, self.k_norm = get("q_norm.weight"), get("k_norm.weight")
        self.per_head_norm = cfg.qk_norm == "per_head" or (cfg.qk_norm == "weightless" and rope)
        if cfg.qk_norm == "weightless" and rope:  # Llama-4: x / rms(x) per head, after the rotary in transformers;
            # the rotation keeps each head's sum of squares, so normalising first is the same map
            self.q_norm = self.k_norm = torch.ones(cfg.head_dim, dtype=torch.float32,
                                                   device=self.wq.device if isinstance(self.wq, torch.Tensor) else None)
        # Gemma-4: values RMS-normed per head without a weight (and, where k_eq_v, taken from the key projection)
        self.v_unit = torch.ones(cfg.head_dim, dtype=torch.float32,
                                 device=self.wq.device if isinstance(self.wq, torch.Tensor) else None) \
            if cfg.v_norm else None
        self.sinks = get("sinks")
        self._native_f32: tuple | None = None  # q_norm, k_norm, sinks as float32 for the native kernel

    @staticmethod
    def cache_entries_for(cfg: AttentionConfig) -> dict[str, tuple[int, ...]]:
        """Per-token KV-cache entries: keys and values of the KV heads."""
        return {"k": (cfg.num_kv_heads, cfg.head_dim), "v": (cfg.num_kv_heads, cfg.head_dim)}

    def cache_entries(self) -> dict[str, tuple[int, ...]]:
        return self.cache_entries_for(self.cfg)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        bsz, steps, _ = x.shape
        if cfg.k_eq_v:  # Gemma-4's full layers: the values are the key projection as it comes
            q, k = linear_many(x, (self.wq, self.wk), (self.bq, self.bk))
            v = k
        else:
            q, k, v = linear_many(x, (self.wq, self.wk, self.wv), (self.bq, self.bk, self.bv))
        if self.v_unit is not None:
            v = rms_norm(v.reshape(bsz, steps, cfg.num_kv_heads, cfg.head_dim), self.v_unit, self.eps).reshape(
                bsz, steps, -1)
        gate = None
        if cfg.gated:  # Qwen3-Next: per head, its q then its gate
            q, gate = q.view(bsz, steps, cfg.num_heads, 2 * cfg.head_dim).split(cfg.head_dim, dim=-1)
            q, gate = q.reshape(bsz, steps, -1), torch.sigmoid(gate.reshape(bsz, steps, -1))
        if cfg.qk_norm == "full":  # OLMoE normalises the whole projection
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        if cfg.nope_temperature and not self.rope:  # Llama-4's NoPE layers: a query temperature by position
            floor_scale, attn_scale = cfg.nope_temperature
            pos = batch.positions.to(q.device, torch.float32)
            q = q * (torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0)[..., None].to(q.dtype)
        if steps == 1 and not batch.packed:
            out = self._native_decode(q, k, v, batch, cache, cos_sin)
            if out is not None:
                out = out.view(bsz, 1, -1)
                return linear(out if gate is None else out * gate, self.wo, self.bo)
        q = q.view(bsz, steps, cfg.num_heads, cfg.head_dim)
        k = k.view(bsz, steps, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(bsz, steps, cfg.num_kv_heads, cfg.head_dim)
        if self.per_head_norm:  # Qwen3 normalises each head
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, Dh]
        if self.rope:
            q, k = self._rotate(q, cos_sin), self._rotate(k, cos_sin)
        cache.write(self.layer, "k", k.transpose(1, 2), batch)
        cache.write(self.layer, "v", v, batch)

        def read_kv(seq: int, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor]:
            # keys j0..j1-1 of one sequence, read back from the pool (so a reused prefix and a fresh one are
            # the same numbers), [Hk, kb, Dh] in the compute dtype
            return tuple(cache.read_range(self.layer, name, batch, seq, j0, j1, q.dtype).transpose(0, 1)
                         for name in ("k", "v"))

        out = attend_paged(q, read_kv, batch.starts, batch.lengths, cfg.scaling, window=self.window,
                           sinks=self.sinks, value_dim=cfg.head_dim, rows=batch.rows, offsets=batch.offsets,
                           chunk=self.chunk)
        return linear(out if gate is None else out * gate, self.wo, self.bo)

    def _native_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                       cache: KVCache, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        """One new token per row on the CPU: norms, rotary, cache write and attention in one native call
        (native/cpu/attn_decode.c; the torch code below is its reference). None when it does not apply."""
        lib = native()
        if lib is None or q.device.type != "cpu":
            return None
        k_store, v_store = cache.entry(self.layer, "k"), cache.entry(self.layer, "v")
        if k_store.dtype not in (torch.float32, torch.bfloat16, torch.int8) or k_store.device.type != "cpu":
            return None
        q_norm, k_norm, sinks = self.native_f32()
        rows = q.shape[0]
        if self.rope:
            cos, sin = (t[:, 0].float().contiguous() for t in cos_sin)
        else:
            cos = sin = torch.empty(rows, 0)
        return lib.attn_decode(
            q.reshape(rows, -1).float().contiguous(), k.reshape(rows, -1).float().contiguous(),
            v.reshape(rows, -1).float().contiguous(), num_heads=self.cfg.num_heads,
            num_kv_heads=self.cfg.num_kv_heads, q_norm=q_norm, k_norm=k_norm, eps=self.eps,
            rot_dim=self.rotary.dim if self.rope else 0, interleaved=self.rotary.interleaved, cos=cos, sin=sin,
            k_cache=k_store,
            v_cache=v_store, block_tables=cache.table_tensor(batch), starts=batch.starts,
            positions=batch.positions[:, 0].tolist(),
            lengths=batch.lengths, num_keys=batch.num_keys, window=self.window, scale=self.cfg.scaling,
            sinks=sinks, k_scale=cache.entry_scale(self.layer, "k"), v_scale=cache.entry_scale(self.layer, "v"),
            chunk=self.chunk)

    def native_f32(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The per-head q/k norm weights (None unless per-head) and the sinks as float32, for the native
        decode kernels (made once)."""
        if self._native_f32 is None:
            f32 = lambda t: None if t is None else t.detach().float().contiguous()  # noqa: E731
            per_head = self.per_head_norm
            self._native_f32 = (f32(self.q_norm) if per_head else None, f32(self.k_norm) if per_head else None,
                                f32(self.sinks))
        return self._native_f32

    def _rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dim = self.rotary.dim
        if dim == x.shape[-1]:
            return self.rotary.apply(x, *cos_sin)
        return torch.cat([self.rotary.apply(x[..., :dim], *cos_sin), x[..., dim:]], dim=-1)
