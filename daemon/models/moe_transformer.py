"""MoeTransformer: the decoder stack shared by every supported family (weights in, logits out).

Shapes: B sequences, T new tokens per step, D hidden, V vocabulary.
"""

from __future__ import annotations


import torch

from moed.cache.kv_cache import DEFAULT_BLOCK_SIZE, KVCache, kv_bytes_per_token, kv_dtype_for
from moed.errors import ModelFormatError
from moed.experts.executor import ExpertExecutor
from moed.layers.attention import MhaAttention
from moed.layers.dense_mlp import DenseMlp
from moed.layers.gated_deltanet import LinearAttentionBlock
from moed.layers.gemma_feed_forward import GemmaFeedForward
from moed.layers.kv_compressor import cache_entries_for as compressed_cache_entries
from moed.layers.linear import embedding, linear
from moed.layers.mla_attention import MlaAttention
from moed.layers.moe import MoeLayer
from moed.kernels.native_cpu import torch_paths
from moed.layers.norms import add_rms_norm, rms_norm
from moed.layers.rotary import RotaryEmbedding
from moed.models.decode_chain import DecodeChain, Unsupported
from moed.models.model_config import ModelConfig
from moed.models.weight_spec import expected_weight_shapes
from moed.runner.forward_batch import ForwardBatch


def device_mode_blocker(weights: dict) -> str | None:
    """Why these weights cannot live on a device (None when they can)."""
    packed = [name for name, w in weights.items() if not isinstance(w, torch.Tensor)]
    if packed:
        return (f"{len(packed)} weights are kept packed from a quantised GGUF (e.g. {packed[0]!r}); the device "
                "path multiplies plain tensors only, so the model stays on the host")
    return None


class MoeTransformer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], executor: ExpertExecutor,
                 *, where: str = "model", device=None) -> None:
        """``device``: run on it (non-expert weights and the KV cache there, hidden states kept there,
        the layers' torch code); None runs on the host with the native CPU kernels."""
        check_weights(config, weights, where)
        if config.norm_offset:  # (offset + w) RMSNorms: folded into the weights once, in float32
            weights = {name: w.float() + config.norm_offset if _offset_norm(name) else w for name, w in weights.items()}
        self.config = config
        self.executor = executor
        self.device = device
        self._weight_device_bytes = self._kv_device_bytes = 0
        if device is not None:
            weights = {name: device.adopt(w) for name, w in weights.items()}
            self._weight_device_bytes = sum(w.numel() * w.element_size() for w in weights.values())
            self._book_device_bytes()
        self.weights = weights  # what the model runs with (on its device when it has one)
        embed = weights["model.embed_tokens.weight"]
        self.kv_dtype = kv_dtype_for(embed.dtype if isinstance(embed, torch.Tensor) else None)
        self.rotary = RotaryEmbedding(config.rope, config.max_position_embeddings)
        # one rotary per distinct RopeConfig (Gemma-4's full layers have their own): each layer's index into it
        self.rotaries = [self.rotary]
        if config.full_rope is not None:
            self.rotaries.append(RotaryEmbedding(config.full_rope, config.max_position_embeddings))
        self.layer_rotary = [int(config.layer_rope(i) is config.full_rope and config.full_rope is not None)
                             for i in range(config.num_layers)]
        # Gemma-4 scales the embedding by sqrt(hidden_size) rounded to the table's dtype, as transformers does
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=embed.dtype
                                              if isinstance(embed, torch.Tensor) else torch.float32)) \
            if config.scale_embedding else 1.0
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = weights["model.embed_tokens.weight"] if config.tie_word_embeddings else weights["lm_head.weight"]
        self.layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}"
            if config.is_linear(i):
                attention = LinearAttentionBlock(config.linear_attention.layer(weights, f"{prefix}.linear_attn"), i)
            elif config.attention.kind == "mla":
                attention = MlaAttention(config.attention, weights, f"{prefix}.self_attn", i, self.rotary,
                                         config.sliding_windows[i], config.rms_norm_eps,
                                         index_source=config.index_source(i) if config.attention.index_topk else None,
                                         rope=config.uses_rope(i))
            else:
                attention = MhaAttention(config.layer_attention(i), weights, f"{prefix}.self_attn", i,
                                         self.rotaries[self.layer_rotary[i]], config.sliding_windows[i],
                                         config.rms_norm_eps, chunk=config.attention_chunk(i), rope=config.uses_rope(i))
            if config.layer_recipe == "gemma4":  # sandwich norms, dense MLP beside the experts, output scale
                moe = MoeLayer(config.moe, weights, f"{prefix}.mlp", config.moe_layer_index(i), executor) \
                    if config.moe_layers[i] else None
                self.layers.append((weights[f"{prefix}.input_layernorm.weight"], attention, None,
                                    GemmaFeedForward(weights, prefix, config.rms_norm_eps, moe, config.mlp_activation)))
                continue
            if not config.has_mlp(i):  # Nemotron-H: a mixer block followed by another mixer
                mlp = None
            elif config.moe_layers[i]:
                mlp = MoeLayer(config.moe, weights, f"{prefix}.mlp", config.moe_layer_index(i), executor)
            else:
                mlp = DenseMlp(weights, f"{prefix}.mlp", config.mlp_activation)
            self.layers.append((weights[f"{prefix}.input_layernorm.weight"], attention,
                                weights.get(f"{prefix}.post_attention_layernorm.weight"), mlp))
        self._chain: DecodeChain | Unsupported | None = None  # built at the first decode step

    def decode_chain(self) -> DecodeChain | Unsupported:
        """The native decode chain of this model (models/decode_chain.py), or why there is none."""
        if self._chain is None:
            self._chain = DecodeChain.build(self)
        return self._chain

    def cache_entries(self) -> list[dict[str, tuple[int, ...]]]:
        return [attention.cache_entries() for _, attention, _, _ in self.layers]

    def state_shapes(self) -> list[dict[str, tuple[int, ...]]] | None:
        """Per-sequence state of each layer (None: a model without any)."""
        if not self.config.has_recurrent_state:
            return None
        return [getattr(attention, "state_shapes", dict)() for _, attention, _, _ in self.layers]

    @property
    def has_recurrent_state(self) -> bool:
        return self.config.has_recurrent_state

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A KV pool of ``num_slots`` static sequences of up to ``max_len`` tokens (``kv_cache_bytes`` of it),
        in the model's KV dtype, with their per-sequence state if the model has any; on the model's
        device when it has one."""
        return self._adopt_cache(KVCache.for_slots(self.cache_entries(), num_slots, max_len, self.kv_dtype,
                                                   self._cache_device(), state_shapes=self.state_shapes()))

    def new_pool(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, state_slots: int = 0) -> KVCache:
        """A KV pool of ``num_blocks`` blocks that steps address through block tables (and ``state_slots``
        per-sequence states for a hybrid model: steps name them in ``ForwardBatch.state_slots``)."""
        shapes = self.state_shapes()
        return self._adopt_cache(KVCache(self.cache_entries(), num_blocks, block_size, self.kv_dtype,
                                         self._cache_device(), state_shapes=shapes,
                                         num_state_slots=state_slots if shapes else 0))

    def resize_pool(self, cache: KVCache, num_blocks: int, moves: list[tuple[int, int]]) -> KVCache:
        """``cache`` as a pool of ``num_blocks`` blocks (contents kept through ``moves``), booked anew."""
        return self._adopt_cache(cache.resized(num_blocks, moves))

    @property
    def weight_device_bytes(self) -> int:
        """The non-expert weights' bytes on the device (0 on the host)."""
        return self._weight_device_bytes

    def _cache_device(self) -> torch.device | None:
        return None if self.device is None else self.device.compute_device

    def _adopt_cache(self, cache: KVCache) -> KVCache:
        if self.device is not None:
            for entries in (*cache.layers, *cache.states):
                for t in entries.values():
                    self.device.adopt(t)
            self._kv_device_bytes = cache.nbytes() + cache.state_nbytes()
            self._book_device_bytes()
        return cache

    def _book_device_bytes(self) -> None:
        """Tell the executor's stats what the model holds on the device (weights + the newest KV cache)."""
        stats = getattr(self.executor, "stats", None)
        if stats is not None:
            stats.model_device_bytes = self._weight_device_bytes + self._kv_device_bytes

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, *, last_only: bool = True) -> torch.Tensor:
        """Run one step; returns logits [S, V] of each sequence's last new token, or [R, T, V] of every place (on
        the host)."""
        begin_step = getattr(self.executor, "begin_step", None)
        if begin_step is not None:  # executors that trace routing or plan by phase want to know
            begin_step("prefill" if max(batch.lengths) > 1 else "decode",
                       [batch.slots[s] for s in batch.token_sequences()], batch.positions[batch.valid].tolist())
        if self.device is None:
            return self._forward(batch, cache, [r.cos_sin(batch.positions) for r in self.rotaries], last_only)
        dev = self.device
        with torch_paths():  # the layers' torch code, as on CUDA tensors (the emulated device's are CPU ones)
            cos_sins = [tuple(dev.to_device(t) for t in r.cos_sin(batch.positions)) for r in self.rotaries]
            logits = self._forward(batch.moved(dev.to_device), cache, cos_sins, last_only)
            return dev.to_host(logits)[0]  # the step's last host sync: the samplers read the logits

    def _forward(self, batch: ForwardBatch, cache: KVCache, cos_sins: list[tuple[torch.Tensor, torch.Tensor]],
                 last_only: bool) -> torch.Tensor:
        """``cos_sins``: each rotary's (cos, sin) at the batch's positions (``self.rotaries``)."""
        eps = self.config.rms_norm_eps
        x = embedding(batch.input_ids, self.embed)  # [B, T, D] float32 (the table may be bf16 or packed)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        valid, all_valid = batch.valid, batch.all_valid
        chain = (self.decode_chain() if all_valid and x.shape[1] == 1 and not batch.packed and self.device is None
                 else None)
        if isinstance(chain, DecodeChain) and chain.applies(x, cache):
            # decode on the CPU executor: every layer (and the final norm and lm_head when their weights
            # suit it) in one native call, the same bits as the code below
            x, logits = chain.run(x, batch, cache, cos_sins[0])
            if logits is not None:
                return logits if last_only else logits[:, None]
            layers = ()
        else:
            layers = self.layers
        for i, (input_norm, attention, post_norm, mlp) in enumerate(layers):
            mixed = attention.forward(rms_norm(x, input_norm, eps), batch, cache, cos_sins[self.layer_rotary[i]])
            if isinstance(mlp, GemmaFeedForward):
                x = mlp.forward(x, mixed, valid, all_valid)
                continue
            if mlp is None:
                x = x + mixed
                continue
            x, h = add_rms_norm(x, mixed, post_norm, eps)
            if isinstance(mlp, MoeLayer):
                if all_valid:  # decode, packed steps and unpadded prefill: every place is a real token
                    x = x + mlp.forward(h.view(-1, h.shape[-1])).view(h.shape)
                else:
                    # route real tokens only: padding must not reach experts (or caches and traces)
                    out = torch.zeros_like(h)
                    out[valid] = mlp.forward(h[valid])
                    x = x + out
            else:
                x = x + mlp.forward(h)
        if last_only:
            rows, last = (torch.tensor(t) for t in batch.last_places())
            if self.device is not None:
                rows, last = self.device.to_device(rows), self.device.to_device(last)
            x = x[rows, last][:, None]  # [S, 1, D]
        logits = linear(rms_norm(x, self.final_norm, eps), self.lm_head)
        if self.config.final_logit_softcapping:  # Gemma-4: tanh(l / c) * c
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits[:, 0] if last_only else logits


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], where: str) -> None:
    """Every expected non-expert tensor is present with the shape config.json implies."""
    for name, shape in expected_weight_shapes(config).items():
        tensor = weights.get(name)
        if tensor is None:
            raise ModelFormatError(f"{where}: tensor {name!r} is missing (config.json expects shape {list(shape)})")
        if tuple(tensor.shape) != shape:
            raise ModelFormatError(
                f"{where}: tensor {name!r} has shape {list(tensor.shape)} but config.json implies {list(shape)}; "
                "the config and the weights do not belong together"
            )


def kv_cache_entries(config: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """The per-token KV entries of attention layer ``layer`` (default: the largest layer's), name -> shape,
    from the config alone."""
    if config.attention.kind == "compressed":  # DeepSeek-V4 (planned; layers/kv_compressor.py)
        layer = 0 if layer is None else layer
        return compressed_cache_entries(config.attention, config.compress_ratios[layer], config.has_indexer(layer))
    if config.attention.kind != "mla":
        return MhaAttention.cache_entries_for(config.layer_attention(layer if layer is not None else 0))
    if layer is None:
        layer = next((i for i in range(config.num_layers) if config.has_indexer(i)), 0)
    return MlaAttention.cache_entries_for(config.attention, indexer=config.has_indexer(layer))


def kv_cache_bytes(config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of K/V ``new_cache(num_slots, max_len)`` allocates with ``dtype`` K/V (int8: q8_0 with its
    scales), from the config alone (checked before a load; whole blocks per slot; a hybrid model's linear
    layers keep none)."""
    tokens = -(-max_len // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE
    layers = [kv_cache_entries(config, i) for i in range(config.num_layers) if not config.is_linear(i)]
    return kv_bytes_per_token(layers, dtype) * num_slots * tokens


def _offset_norm(name: str) -> bool:
    """An RMSNorm weight that scales by (offset + w): all but the gated DeltaNet's output norm."""
    return name.endswith("norm.weight") and ".linear_attn." not in name
