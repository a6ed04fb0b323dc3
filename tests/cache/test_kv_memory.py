"""KV memory at real sizes: a 32k-token context of the Qwen3-30B-A3B shape (48 layers, 4 KV heads x 128)
costs what its tokens need in a paged bf16 pool, not max_batch preallocated float32 slots.

Pools are made on the meta device: their byte counts are exact, nothing is allocated.
"""

from __future__ import annotations

import torch

from helpers.synthetic_checkpoint import qwen3_moe_config
from moed.cache.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from moed.engine.kv_manager import kv_pool_tokens
from moed.layers.attention import MhaAttention
from moed.models.families import parse_model_config
from moed.models.moe_transformer import kv_cache_bytes

GIB = 1 << 30


def test_a_32k_context_of_the_bench_model_shape_fits_in_three_gib_of_bf16_blocks():
    cfg = qwen3_moe_config(num_layers=48).to_dict()
    cfg["max_position_embeddings"] = 40960
    config = parse_model_config(cfg)
    entries = [MhaAttention.cache_entries_for(config.attention)] * config.num_layers
    context = 32768
    pool = KVCache(entries, 32768 // DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE, torch.bfloat16, torch.device("meta"))
    assert pool.nbytes() == kv_cache_bytes(config, 1, context, torch.bfloat16) == 3 * GIB  # 96 KiB per token
    # what the engine's default pool for that context takes (two whole contexts), whatever max_batch is
    assert kv_pool_tokens(context, max_batch=8) == 2 * context
    # before paging: float32, one preallocated [max_len] run per batch slot: 6 GiB each, 48 GiB for 8
    assert kv_cache_bytes(config, 8, context, torch.float32) == 48 * GIB
