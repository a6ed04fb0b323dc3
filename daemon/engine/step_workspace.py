"""The working memory of one model step: the activations a step of T new tokens holds at its peak.

The KV pool, recurrent states and checkpoints, the weights and the expert cache are booked by size;
a step's activations come on top, and they grow with the step's tokens: a device prefill step of
8192 tokens through DeepSeek-V3's experts holds gigabytes (every routed row's gate/up, activation and
down output at once: experts/device_ffn.py). This is an upper estimate worked out from the config
and the layers' own chunk sizes, float32 throughout (the activations' dtype), so that the load plan
(host RAM) and the device share (VRAM) can set it aside before the KV pool and the expert cache take
the rest. tests/engine/test_step_workspace.py holds it against the peak a real step reaches.
"""

from __future__ import annotations

from moed.layers import mla_attention, paged_attention, sparse_indexer

F32 = 4


def _attention(config, tokens: int, reference_blocks: bool, layer: int = 0) -> int:
    """Floats of one attention layer's step beyond the hidden states: projections, rotated copies, the
    output, and one key block read from the pool (widened), plus a block's scores where the reference
    block runs (on a device)."""
    a = config.layer_attention(layer)
    if a.kind == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        per_token = (3 * a.num_heads * qk  # q, its split halves and the concatenated query
                     + 2 * (a.kv_lora_rank + a.qk_rope_head_dim)  # kv_a's output, the normed latent
                     + 2 * a.num_heads * a.v_head_dim)  # the output and o_proj's input
        block = mla_attention.MLA_KEY_BLOCK * a.num_heads * (qk + 2 * a.v_head_dim) * 2  # expanded keys, values
        if a.index_topk:  # sparse attention: the indexer's queries, keys and weights, and the chosen positions
            per_token += a.index_num_heads * (a.index_head_dim + 1) + a.index_head_dim + 2 * a.index_topk  # int64
            block += sparse_indexer.SCORE_FLOATS + sparse_indexer.QUERY_TILE * (a.index_topk + sparse_indexer.KEY_CHUNK) * 3
    elif a.kind == "compressed":  # DeepSeek-V4 (planned): q, the shared K=V row, the output and its groups, the
        # compressors' projections, and each query's scores over its window and chosen compressed entries
        per_token = (3 * a.num_heads * a.head_dim + 8 * a.head_dim + a.o_groups * a.o_lora_rank
                     + a.index_num_heads * (a.index_head_dim + 1) + 4 * a.index_head_dim
                     + a.num_heads * (config.sliding_windows[0] + a.index_topk))
        block = paged_attention.KEY_BLOCK * a.head_dim * 2
    else:
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        per_token = (3 if a.gated else 2) * q + 4 * kv + 2 * q  # q, k, v and their rotated/normed copies, out
        block = paged_attention.KEY_BLOCK * 2 * kv * 2  # a key block's k and v, read and widened
    scores = 3 * paged_attention.REFERENCE_SCORES if reference_blocks else 0  # scores, probabilities, their exp
    return tokens * (per_token + config.hidden_size) + block + scores


def _mlp(config, tokens: int, layer: int) -> int:
    """Floats of one MoE (or dense MLP) layer's step: router logits, every routed row's gathered input,
    gate/up, activation, output and weighted output at once, the shared expert's."""
    d = config.hidden_size
    if not config.has_mlp(layer):
        return 0
    dense = tokens * (3 * config.dense_intermediate_size + d)
    if not config.moe_layers[layer]:
        return dense
    if config.layer_recipe == "gemma4":  # the dense MLP beside the experts, and their inputs' own norms
        dense += 3 * tokens * d
    moe = config.moe
    rows = tokens * moe.top_k
    shared = tokens * (3 * moe.shared_intermediate_size + d) if moe.shared_intermediate_size else 0
    beside = dense if config.layer_recipe == "gemma4" else 0
    return tokens * 2 * moe.num_experts + rows * (3 * d + 3 * moe.intermediate_size) + shared + beside


def _linear_attention(config, tokens: int) -> int:
    """Floats of a linear-attention layer's step (gated DeltaNet or Mamba-2: its config's ``step_floats``) and
    its output."""
    return config.linear_attention.step_floats(tokens) + tokens * config.hidden_size


# what the counted tensors do not show: temporaries of one expression alive together, the native kernels'
# scratch, and heap chunks the allocator cannot hand to a larger request (measured at 4096 tokens: the
# peak RSS rise of a step is 0.5-0.9 of the estimate with this factor, on the CPU and the emulated device)
OVERHEAD = 1.6


def step_workspace_bytes(config, tokens: int, *, sequences: int = 1, device_type: str = "cpu") -> int:
    """Bytes of activations a step of ``tokens`` new tokens of up to ``sequences`` sequences holds at its
    peak on a device of ``device_type`` (the torch device type: "cpu" for the CPU and the emulated device):
    the hidden states and their norm (3 x T x D) plus the largest layer part (a layer's temporaries go
    before the next one's) or the last tokens' logits, times OVERHEAD."""
    if tokens <= 0:
        return 0
    reference = device_type != "cpu"  # blocks run block_reference there: a block's scores exist
    parts = [_attention(config, tokens, reference, i) if not config.is_linear(i) else _linear_attention(config, tokens)
             for i in range(config.num_layers)]
    parts += [_mlp(config, tokens, i) for i in range(config.num_layers)]
    parts.append(2 * min(tokens, sequences) * config.vocab_size)  # the logits of each sequence's last token
    return int(F32 * OVERHEAD * (3 * tokens * config.hidden_size + max(parts)))
