"""DeepseekV4Transformer: DeepSeek-V4 run by moed's engine (issue #33), the model ``models/deepseek_v4_reference.py``
composes over whole sequences, here step by step on the paged cache.

The residual is ``hc_mult`` streams per place (``[R, T, n, D]``); each layer mixes them into its attention's input
and its MoE's (``layers/hyper_connections.py``) and merges the block's output back. Attention runs on the paged
cache (``layers/compressed_attention.CompressedAttention``: shared K=V rows, compressed entries, open windows in
the sequences' state slots); the MoE routes by sqrt-softplus scores (hash layers: the token's tid2eid row) and runs
its routed experts on the executor (clamped SwiGLU banks) and its shared expert here (clamped SwiGLU). The model
stays on the host (a device may still cache and run experts); a prefix is reused up to a state checkpoint at a
multiple of the largest compression ratio (``checkpoint_granularity``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moed.cache.kv_cache import DEFAULT_BLOCK_SIZE, KVCache, kv_dtype_for
from moed.experts.executor import ExpertExecutor
from moed.layers import hyper_connections as hc
from moed.layers.compressed_attention import CompressedAttention, CompressedAttentionWeights
from moed.layers.linear import embedding, linear
from moed.layers.moe import route
from moed.layers.norms import rms_norm
from moed.layers.rotary import RotaryEmbedding
from moed.models.decode_chain import Unsupported
from moed.models.model_config import ModelConfig
from moed.runner.forward_batch import ForwardBatch


class V4Moe:
    """One layer's MoE: the router (sqrt-softplus scores; a hash layer's tid2eid table), the routed experts on the
    executor, the clamped SwiGLU shared expert."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], layer: int, executor: ExpertExecutor):
        m = f"model.layers.{layer}.mlp"
        self.cfg, self.moe_layer, self.executor = config.moe, config.moe_layer_index(layer), executor
        self.router = weights[f"{m}.router.weight"]
        self.score_bias = weights.get(f"{m}.router.score_bias")
        table = weights.get(f"{m}.router.tid2eid")
        self.table = None if table is None else table.long()  # an fp32 load widens it: the ids are exact
        self.shared = tuple(weights[f"{m}.shared.{p}_proj.weight"] for p in ("gate", "up", "down"))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """``x [N, D]``, ``token_ids [N]`` -> ``[N, D]`` float32."""
        ids, gates = route(self.cfg, x, self.router, None, self.score_bias, token_ids=token_ids, table=self.table)
        out = self.executor.run(self.moe_layer, x, ids, gates.to(x.dtype))
        limit = self.cfg.swiglu_limit
        gate, up, down = self.shared
        g = linear(x, gate).clamp(max=limit)
        u = linear(x, up).clamp(min=-limit, max=limit)
        return out + linear(F.silu(g) * u, down)


class DeepseekV4Transformer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], executor: ExpertExecutor,
                 *, where: str = "model", device=None) -> None:
        del where, device  # the model stays on the host (compressed attention has no device form yet)
        self.config, self.executor, self.device, self.weights = config, executor, None, weights
        self.embed = weights["model.embed_tokens.weight"]
        self.kv_dtype = kv_dtype_for(self.embed.dtype if isinstance(self.embed, torch.Tensor) else None)
        self.final_norm, self.lm_head = weights["model.norm.weight"], weights["lm_head.weight"]
        self.head = tuple(weights[f"model.hc_head.hc_{p}"] for p in ("fn", "base", "scale"))
        rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
        compress_rotary = RotaryEmbedding(config.compress_rope, config.max_position_embeddings)
        self.rotary = rotary
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}"
            attention = CompressedAttention(
                config.attention, CompressedAttentionWeights.from_weights(weights, f"{p}.attn"), i,
                ratio=config.compress_ratios[i], window=config.sliding_windows[i], rotary=rotary,
                compress_rotary=compress_rotary, eps=config.rms_norm_eps)
            mixes = {b: tuple(weights[f"{p}.hc_{b}_{part}"] for part in ("fn", "base", "scale")) for b in ("attn", "ffn")}
            self.layers.append((mixes, weights[f"{p}.attn_norm.weight"], attention, weights[f"{p}.ffn_norm.weight"],
                                V4Moe(config, weights, i, executor)))

    # ---- what the engine asks of a model (as MoeTransformer)

    def decode_chain(self) -> Unsupported:
        return Unsupported("DeepSeek-V4 (compressed attention and hyper-connections) runs layer by layer")

    def cache_entries(self) -> list[dict[str, tuple[int, ...]]]:
        return [attention.cache_entries() for _, _, attention, _, _ in self.layers]

    def state_shapes(self) -> list[dict[str, tuple[int, ...]]] | None:
        return [attention.state_shapes() for _, _, attention, _, _ in self.layers] if self.has_recurrent_state else None

    @property
    def has_recurrent_state(self) -> bool:
        return any(self.config.compress_ratios)

    @property
    def checkpoint_granularity(self) -> int:
        """Prefixes are reused (and states checkpointed) only at multiples of this: every compression window before
        such a point has closed, its entry written in blocks the prefix owns (docs/design.md, DeepSeek-V4)."""
        return math.lcm(DEFAULT_BLOCK_SIZE, *[r for r in self.config.compress_ratios if r] or [1])

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache.for_slots(self.cache_entries(), num_slots, max_len, self.kv_dtype,
                                 state_shapes=self.state_shapes())

    def new_pool(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, state_slots: int = 0) -> KVCache:
        shapes = self.state_shapes()
        return KVCache(self.cache_entries(), num_blocks, block_size, self.kv_dtype, state_shapes=shapes,
                       num_state_slots=state_slots if shapes else 0)

    def resize_pool(self, cache: KVCache, num_blocks: int, moves: list[tuple[int, int]]) -> KVCache:
        return cache.resized(num_blocks, moves)

    @property
    def weight_device_bytes(self) -> int:
        return 0

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, *, last_only: bool = True) -> torch.Tensor:
        """One step; logits ``[S, V]`` of each sequence's last new token, or ``[R, T, V]`` of every place."""
        begin_step = getattr(self.executor, "begin_step", None)
        if begin_step is not None:
            begin_step("prefill" if max(batch.lengths) > 1 else "decode",
                       [batch.slots[s] for s in batch.token_sequences()], batch.positions[batch.valid].tolist())
        cfg, eps = self.config, self.config.rms_norm_eps
        hyper = cfg.hyper
        x = embedding(batch.input_ids, self.embed)  # [R, T, D]
        rows, steps, d = x.shape
        valid = batch.valid
        ids = batch.input_ids[valid]
        streams = hc.expand(x.reshape(-1, d), hyper.streams)  # [R T, n, D]
        for mixes, attn_norm, attention, ffn_norm, moe in self.layers:
            post, comb, collapsed = hc.block_mixes(streams, *mixes["attn"], hyper)
            out = attention.forward(rms_norm(collapsed, attn_norm, eps).view(rows, steps, d), batch, cache)
            streams = hc.merge(streams, out.reshape(-1, d), post, comb)
            post, comb, collapsed = hc.block_mixes(streams, *mixes["ffn"], hyper)
            h = rms_norm(collapsed, ffn_norm, eps).view(rows, steps, d)
            out = torch.zeros(rows, steps, d)
            out[valid] = moe.forward(h[valid], ids)  # real tokens only: padding must not reach the experts
            streams = hc.merge(streams, out.reshape(-1, d), post, comb)
        final = hc.head_collapse(streams, *self.head, hyper).view(rows, steps, d)
        if last_only:
            r, last = (torch.tensor(t) for t in batch.last_places())
            final = final[r, last][:, None]
        logits = linear(rms_norm(final, self.final_norm, eps), self.lm_head)
        return logits[:, 0] if last_only else logits
