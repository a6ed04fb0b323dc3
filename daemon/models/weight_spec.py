"""The canonical non-expert tensors a ModelConfig implies, with their shapes (for validation)."""

from __future__ import annotations

from moed.models.model_config import ModelConfig


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    if config.attention.kind == "compressed":
        return _deepseek_v4_shapes(config)
    d, att, moe = config.hidden_size, config.attention, config.moe
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (d,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (d,)
        if config.is_linear(i):
            shapes.update(config.linear_attention.weight_shapes(f"{p}.linear_attn", d))
        else:
            shapes.update(_attention_shapes(config, f"{p}.self_attn", i))
        if config.layer_recipe == "gemma4":
            shapes.update(_gemma4_feed_forward_shapes(config, p, i))
            continue
        if not config.has_mlp(i):  # Nemotron-H: a mixer block with no feed-forward block after it
            del shapes[f"{p}.post_attention_layernorm.weight"]
            continue
        gated = config.mlp_activation != "relu2"
        if config.moe_layers[i]:
            m = f"{p}.mlp"
            shapes[f"{m}.router.weight"] = (moe.num_experts, d)
            if moe.has_router_bias:
                shapes[f"{m}.router.bias"] = (moe.num_experts,)
            if moe.has_score_correction_bias:
                shapes[f"{m}.router.score_bias"] = (moe.num_experts,)
            if moe.shared_intermediate_size:
                shapes.update(_mlp_shapes(f"{m}.shared", d, moe.shared_intermediate_size, gated))
                if moe.has_shared_expert_gate:
                    shapes[f"{m}.shared_gate.weight"] = (1, d)
        else:
            shapes.update(_mlp_shapes(f"{p}.mlp", d, config.dense_intermediate_size, gated))
    return shapes


def _gemma4_feed_forward_shapes(config: ModelConfig, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    """Gemma-4's norms around the attention and the feed-forward part, its dense MLP, its router (with its input
    and per-expert scales) and the layer's output scale (layers/gemma_feed_forward.py)."""
    d, moe = config.hidden_size, config.moe
    shapes = {f"{p}.{n}.weight": (d,) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")}
    shapes[f"{p}.layer_scalar"] = (1,)
    shapes.update(_mlp_shapes(f"{p}.mlp", d, config.dense_intermediate_size))
    if config.moe_layers[layer]:
        for n in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
            shapes[f"{p}.{n}.weight"] = (d,)
        shapes.update({f"{p}.mlp.router.weight": (moe.num_experts, d), f"{p}.mlp.router.input_scale": (d,),
                       f"{p}.mlp.router.expert_scale": (moe.num_experts,)})
    return shapes


def _mlp_shapes(prefix: str, d: int, inter: int, gated: bool = True) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.up_proj.weight": (inter, d), f"{prefix}.down_proj.weight": (d, inter)}
    if gated:  # SwiGLU; Nemotron-H's relu^2 MLPs have no gate
        shapes[f"{prefix}.gate_proj.weight"] = (inter, d)
    return shapes


def _attention_shapes(config: ModelConfig, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    d, att = config.hidden_size, config.layer_attention(layer)
    if att.kind == "mla":
        qk = att.qk_nope_head_dim + att.qk_rope_head_dim
        shapes = {
            f"{p}.kv_a_proj_with_mqa.weight": (att.kv_lora_rank + att.qk_rope_head_dim, d),
            f"{p}.kv_a_layernorm.weight": (att.kv_lora_rank,),
            f"{p}.kv_b_proj.weight": (att.num_heads * (att.qk_nope_head_dim + att.v_head_dim), att.kv_lora_rank),
            f"{p}.o_proj.weight": (d, att.num_heads * att.v_head_dim),
        }
        if att.q_lora_rank:
            shapes[f"{p}.q_a_proj.weight"] = (att.q_lora_rank, d)
            shapes[f"{p}.q_a_layernorm.weight"] = (att.q_lora_rank,)
            shapes[f"{p}.q_b_proj.weight"] = (att.num_heads * qk, att.q_lora_rank)
        else:
            shapes[f"{p}.q_proj.weight"] = (att.num_heads * qk, d)
        if att.has_qkv_bias:
            shapes[f"{p}.kv_a_proj_with_mqa.bias"] = (att.kv_lora_rank + att.qk_rope_head_dim,)
            if att.q_lora_rank:
                shapes[f"{p}.q_a_proj.bias"] = (att.q_lora_rank,)
        if att.has_o_bias:
            shapes[f"{p}.o_proj.bias"] = (d,)
        if config.has_indexer(layer):  # sparse attention's lightning indexer
            x = f"{p}.indexer"
            shapes.update({f"{x}.wq_b.weight": (att.index_num_heads * att.index_head_dim, att.q_lora_rank),
                           f"{x}.wk.weight": (att.index_head_dim, d), f"{x}.k_norm.weight": (att.index_head_dim,),
                           f"{x}.k_norm.bias": (att.index_head_dim,),
                           f"{x}.weights_proj.weight": (att.index_num_heads, d)})
        return shapes
    q_out, kv_out = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    q_rows = 2 * q_out if att.gated else q_out  # a gated q_proj also gives the gate
    shapes = {f"{p}.q_proj.weight": (q_rows, d), f"{p}.k_proj.weight": (kv_out, d),
              f"{p}.v_proj.weight": (kv_out, d), f"{p}.o_proj.weight": (d, q_out)}
    if att.k_eq_v:  # Gemma-4's full layers: the key projection gives the values too
        del shapes[f"{p}.v_proj.weight"]
    if att.has_qkv_bias:
        shapes.update({f"{p}.q_proj.bias": (q_rows,), f"{p}.k_proj.bias": (kv_out,), f"{p}.v_proj.bias": (kv_out,)})
    if att.has_o_bias:
        shapes[f"{p}.o_proj.bias"] = (d,)
    if att.qk_norm == "per_head":
        shapes.update({f"{p}.q_norm.weight": (att.head_dim,), f"{p}.k_norm.weight": (att.head_dim,)})
    elif att.qk_norm == "full":
        shapes.update({f"{p}.q_norm.weight": (q_out,), f"{p}.k_norm.weight": (kv_out,)})
    if att.has_sinks:
        shapes[f"{p}.sinks"] = (att.num_heads,)
    return shapes


def _deepseek_v4_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V4's tensors under DeepSeek's own names (what its checkpoints and transformers store), but the MoE
    parts' canonical ones (``mlp.router.*``, ``mlp.shared.*``); ``mlp.router.tid2eid`` is int64."""
    d, att, moe, n = config.hidden_size, config.attention, config.moe, config.hyper.streams
    heads, hd, ihd = att.num_heads, att.head_dim, att.index_head_dim
    mixes = (2 + n) * n
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,),
        "lm_head.weight": (config.vocab_size, d),
        "model.hc_head.hc_fn": (n, n * d), "model.hc_head.hc_base": (n,), "model.hc_head.hc_scale": (1,)}
    for i in range(config.num_layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.attn"
        shapes.update({f"{p}.attn_norm.weight": (d,), f"{p}.ffn_norm.weight": (d,)})
        for block in ("attn", "ffn"):
            shapes.update({f"{p}.hc_{block}_fn": (mixes, n * d), f"{p}.hc_{block}_base": (mixes,),
                           f"{p}.hc_{block}_scale": (3,)})
        shapes.update({
            f"{a}.wq_a.weight": (att.q_lora_rank, d), f"{a}.q_norm.weight": (att.q_lora_rank,),
            f"{a}.wq_b.weight": (heads * hd, att.q_lora_rank), f"{a}.wkv.weight": (hd, d), f"{a}.norm.weight": (hd,),
            f"{a}.wo_a.weight": (att.o_groups * att.o_lora_rank, heads * hd // att.o_groups),
            f"{a}.wo_b.weight": (d, att.o_groups * att.o_lora_rank), f"{a}.attn_sink": (heads,)})
        ratio = config.compress_ratios[i]
        if ratio:
            csa = config.has_indexer(i)
            c = 2 * hd if csa else hd
            shapes.update({f"{a}.compressor.wkv.weight": (c, d), f"{a}.compressor.wgate.weight": (c, d),
                           f"{a}.compressor.ape": (ratio, c), f"{a}.compressor.norm.weight": (hd,)})
            if csa:
                x = f"{a}.indexer"
                shapes.update({f"{x}.wq_b.weight": (att.index_num_heads * ihd, att.q_lora_rank),
                               f"{x}.weights_proj.weight": (att.index_num_heads, d),
                               f"{x}.compressor.wkv.weight": (2 * ihd, d), f"{x}.compressor.wgate.weight": (2 * ihd, d),
                               f"{x}.compressor.ape": (ratio, 2 * ihd), f"{x}.compressor.norm.weight": (ihd,)})
        m = f"{p}.mlp"
        shapes[f"{m}.router.weight"] = (moe.num_experts, d)
        if config.hash_layers[i]:
            shapes[f"{m}.router.tid2eid"] = (config.vocab_size, moe.top_k)
        else:
            shapes[f"{m}.router.score_bias"] = (moe.num_experts,)
        if moe.shared_intermediate_size:
            shapes.update(_mlp_shapes(f"{m}.shared", d, moe.shared_intermediate_size))
    return shapes
