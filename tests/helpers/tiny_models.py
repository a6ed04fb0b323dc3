"""Tiny random-init transformers models of every supported family, saved as HF directories.

transformers is the reference implementation; these builders are test-only. Weights are scaled
up from transformers' small init so greedy decoding gives varied tokens (sharper parity tests).
Dimensions are multiples of 32 so int4 experts work too.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_next",
            "qwen3_5_moe_text", "deepseek_v32", "glm_moe_dsa", "deepseek_v4", "glm4_moe_lite",
            "ernie4_5_moe", "minimax_m2", "llama4_text", "nemotron_h", "gemma4_text", "kimi_linear")

COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)


def tiny_config(family: str):
    import transformers as tf

    if family == "mixtral":
        return tf.MixtralConfig(**COMMON, intermediate_size=64, num_key_value_heads=2, num_local_experts=8,
                                num_experts_per_tok=2)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=96, num_key_value_heads=2, num_experts=8,
                                 num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1])
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=2,
                                 head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    if family == "olmoe":
        return tf.OlmoeConfig(**COMMON, intermediate_size=64, num_key_value_heads=4, num_experts=8,
                              num_experts_per_tok=2, clip_qkv=8.0)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**COMMON, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=4,
                                   n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                   first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                   qk_rope_head_dim=8, head_dim=8, v_head_dim=16, n_shared_experts=1,
                                   routed_scaling_factor=2.5)
    if family in ("deepseek_v32", "glm_moe_dsa"):
        # DeepSeek Sparse Attention: each query keeps its 8 best keys (the parity prompts are 5, 9 and 13 tokens
        # and decode runs 32 more). Two keys can tie exactly (at 0, when a query's head weights are all negative and
        # few keys score above 0): 16 indexer heads make that rare enough
        sparse = dict(COMMON, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=4,
                      n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                      q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                      n_shared_experts=1, routed_scaling_factor=2.5, index_topk=8, index_n_heads=16,
                      index_head_dim=16)
        if family == "deepseek_v32":
            return tf.DeepseekV32Config(**sparse)
        return tf.GlmMoeDsaConfig(**sparse, indexer_types=["full", "shared", "full"])
    if family == "gpt_oss":
        return tf.GptOssConfig(**COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=16,
                               num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**COMMON, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=2,
                                  head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                  shared_expert_intermediate_size=64, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                  linear_conv_kernel_dim=4,
                                  layer_types=["linear_attention", "full_attention", "linear_attention"])
    if family == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(**COMMON, moe_intermediate_size=64, num_key_value_heads=2, head_dim=32,
                                       num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=64,
                                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                       linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                       layer_types=["linear_attention", "full_attention", "linear_attention"])
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=2,
                                head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                use_qk_norm=True, attention_bias=True)
    if family == "glm4_moe_lite":  # GLM-4.7-Flash: MLA, the first layer dense
        return tf.Glm4MoeLiteConfig(**COMMON, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=4,
                                    n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32,
                                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1,
                                    routed_scaling_factor=1.8)
    if family == "ernie4_5_moe":  # ERNIE-4.5: the first layer dense, one shared expert
        return tf.Ernie4_5_MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=64, num_key_value_heads=2,
                                     moe_num_experts=8, moe_k=2, moe_num_shared_experts=1)
    if family == "minimax_m2":  # MiniMax-M2: full-width q/k norms, rotary on half of each head, sigmoid + bias
        return tf.MiniMaxM2Config(**COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=32,
                                  num_local_experts=8, num_experts_per_tok=2, rotary_dim=16)
    if family == "llama4_text":
        # Llama-4: four layers (chunked rotary attention with chunks of 8 so the parity prompts and 32 decoded tokens
        # cross several, a NoPE layer with its query temperature from position 3 on), MoE on layers 0, 2, 3 and a
        # dense MLP on layer 1, llama3 rotary scaling
        llama = dict(COMMON, num_hidden_layers=4)
        return tf.Llama4TextConfig(**llama, intermediate_size=64, intermediate_size_mlp=96, num_key_value_heads=2,
                                   head_dim=32, num_local_experts=8, num_experts_per_tok=1, moe_layers=[0, 2, 3],
                                   no_rope_layers=[1, 1, 0, 1], attention_chunk_size=8, floor_scale=4, attn_scale=0.25,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})
    if family == "gemma4_text":
        # Gemma-4 26B-A4B's layout in small: sliding layers (window 6) and full ones with their own head size, one KV
        # head whose key projection gives the values, and proportional rotary; experts beside the dense MLP
        return tf.Gemma4TextConfig(**COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=32,
                                   global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
                                   layer_types=["sliding_attention", "full_attention", "full_attention"],
                                   sliding_window=6, enable_moe_block=True, num_experts=8, top_k_experts=2,
                                   moe_intermediate_size=64, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                                   final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "proportional",
                                                                       "partial_rotary_factor": 0.25,
                                                                       "rope_theta": 1000000.0}})
    if family == "kimi_linear":
        # Kimi-Linear: layers KDA, KDA, MLA (no rotary), KDA; the first layer dense, DeepSeek-V3's experts after it
        kimi = {k: v for k, v in COMMON.items() if k not in ("num_hidden_layers", "max_position_embeddings")}
        return tf.KimiLinearConfig(**kimi, num_hidden_layers=4, model_max_length=256, intermediate_size=96,
                                   moe_intermediate_size=32, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, mla_use_nope=True,
                                   linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                                                       "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
                                   num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                                   moe_router_activation_func="sigmoid", moe_renormalize=True,
                                   routed_scaling_factor=2.446, use_grouped_topk=True, num_expert_group=1,
                                   topk_group=1, first_k_dense_replace=1, moe_layer_freq=1)
    if family == "nemotron_h":
        # Nemotron-H: blocks M E M * E M - (Mamba-2, MoE, Mamba-2 followed by attention, attention + MoE, Mamba-2 +
        # dense relu^2 MLP): moed's layers (M+E) (M) (*+E) (M+-); chunks of 8 so the prompts cross several
        nemotron = {k: v for k, v in COMMON.items() if k != "num_hidden_layers"}
        return tf.NemotronHConfig(**nemotron, hybrid_override_pattern="MEM*EM-", num_key_value_heads=2, head_dim=32,
                                  intermediate_size=96, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                                  ssm_state_size=16, conv_kernel=4, chunk_size=8, n_routed_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=64,
                                  moe_shared_expert_intermediate_size=64, routed_scaling_factor=2.5,
                                  norm_topk_prob=True)
    if family == "deepseek_v4":
        # one layer of each kind, windows short enough that the parity prompts (5-13 tokens, then 32 decoded)
        # close several of them: sliding window 8, compressed sparse (ratio 4, its indexer keeps 4 entries; 16
        # indexer heads keep exact score ties rare) and heavily compressed (ratio 8); the first layer hash-routed
        v4 = {k: v for k, v in COMMON.items() if k != "num_attention_heads"}
        return tf.DeepseekV4Config(**v4, num_attention_heads=4, head_dim=32, q_lora_rank=32, moe_intermediate_size=64,
                                   n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
                                   index_n_heads=16, index_head_dim=16, index_topk=4, sliding_window=8,
                                   compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                                   layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                                                "sliding_attention"],
                                   mlp_layer_types=["hash_moe", "moe", "moe"])
    raise ValueError(family)


def build_tiny_model(family: str, dst: Path, *, seed: int = 0, scale: float = 4.0, config=None):
    """Save a tiny ``family`` model (config.json + model.safetensors) to dst; return the transformers model.
    ``config`` replaces ``tiny_config(family)`` (e.g. one with some fields changed)."""
    import transformers as tf

    torch.manual_seed(seed)
    config = config if config is not None else tiny_config(family)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "e_score_correction_bias" in name:  # ERNIE-4.5 keeps it as a [1, E] parameter
                param.normal_(0, 0.05)
            elif name.endswith("router.scale") or name.endswith("per_expert_scale"):  # Gemma-4's router scales
                param.uniform_(0.5, 1.5)
            elif param.dim() >= 2:
                param.mul_(scale)
            elif "bias" in name or "sinks" in name:
                param.normal_(0, 0.5)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
        gen = torch.Generator().manual_seed(seed)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.normal_(0, 0.05)
            elif name.endswith("layer_scalar"):  # Gemma-4's per-layer output scale
                buf.uniform_(0.5, 1.5)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash layers: distinct experts per token
                experts = int(buf.max()) + 1 if int(buf.max()) > 0 else config.n_routed_experts
                buf.copy_(torch.stack([torch.randperm(experts, generator=gen)[: buf.shape[1]]
                                       for _ in range(buf.shape[0])]))
    model.save_pretrained(dst)
    return model


def build_tiny_model_dir(root: Path, family: str = "mixtral", name: str = "tiny") -> Path:
    """``root/name``: a tiny ``family`` model with the tiny test tokenizer, ready to load by name from ``root``."""
    from helpers.tiny_tokenizer import write_tiny_tokenizer

    build_tiny_model(family, root / name)
    write_tiny_tokenizer(root / name)
    return root
