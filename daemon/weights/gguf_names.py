"""llama.cpp's tensor names (convert_hf_to_gguf.py + gguf-py's tensor_mapping.py) -> moed's canonical names.

Canonical names are models/weight_spec.py's (Hugging Face names, MoE parts renamed). Besides the
renames, two tensors are not stored as Hugging Face has them:

- ``llama`` (Mixtral): the converter permutes the rows of Q and K per head from the rotate-half
  order to llama.cpp's interleaved one (``permute``: rows ``[h, 2, d/2]`` -> ``[h, d/2, 2]``);
  ``unpermute_rows`` gives the index that undoes it. The rows are whole quantisation blocks' worth
  of rows, so the raw bytes are reordered before anything is decoded, whatever the type.
- ``deepseek2``: MLA's ``kv_b_proj`` ``[H * (nope + v), kv_lora]`` is written as ``attn_k_b``
  ``[H, kv_lora, nope]`` (transposed, for the absorbed form) and ``attn_v_b`` ``[H, v, kv_lora]``;
  files from before that split keep ``attn_kv_b``.
- ``qwen3next``: the DeltaNet's ``in_proj_qkvz`` (rows grouped per key head: q, k, v, z of head 0,
  then of head 1 ...) is written as ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (all z);
  ``A_log`` as ``ssm_a = -exp(A_log)``; every RMSNorm weight but the DeltaNet's output norm as
  ``1 + w`` (llama.cpp's norm multiplies by the weight; Qwen3-Next's by ``1 + w``).
- ``qwen35moe`` (Qwen3.5/3.6-MoE): as qwen3next, with the four input projections stored one by one;
  where there are more value heads than key heads, every value-head axis (the V rows of
  ``in_proj_qkv`` and of the conv kernel, ``in_proj_z``/``_b``/``_a``, ``A_log``, ``dt_bias`` and the
  columns of ``out_proj``) is reordered from grouped by key head to tiled (``untile_v_heads`` undoes it).
"""

from __future__ import annotations

import torch

# canonical name (after "model.layers.{i}.") -> llama.cpp name (after "blk.{i}.")
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    # MLA (deepseek2)
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    # DeepSeek Sparse Attention's lightning indexer (glm-dsa)
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight", "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
    # MoE
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.router.score_bias": "exp_probs_b.bias",
    "mlp.shared.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared.down_proj.weight": "ffn_down_shexp.weight", "mlp.shared_gate.weight": "ffn_gate_inp_shexp.weight",
    # gated DeltaNet (qwen3next)
    "linear_attn.in_proj_qkvz.weight": "attn_qkv.weight", "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    # Mamba-2 (nemotron_h_moe; conv1d, dt_bias, A_log, norm and out_proj as the DeltaNet's)
    "linear_attn.in_proj.weight": "ssm_in.weight", "linear_attn.in_proj.bias": "ssm_in.bias",
    "linear_attn.conv1d.bias": "ssm_conv1d.bias", "linear_attn.D": "ssm_d", "linear_attn.out_proj.bias": "ssm_out.bias",
    # Kimi Delta Attention (kimi-linear; dt_bias as the DeltaNet's)
    "linear_attn.q_proj.weight": "attn_q.weight", "linear_attn.k_proj.weight": "attn_k.weight",
    "linear_attn.v_proj.weight": "attn_v.weight", "linear_attn.o_proj.weight": "attn_output.weight",
    "linear_attn.q_conv1d.weight": "ssm_conv1d_q.weight", "linear_attn.k_conv1d.weight": "ssm_conv1d_k.weight",
    "linear_attn.v_conv1d.weight": "ssm_conv1d_v.weight", "linear_attn.f_a_proj.weight": "ssm_f_a.weight",
    "linear_attn.f_b_proj.weight": "ssm_f_b.weight", "linear_attn.b_proj.weight": "ssm_beta.weight",
    "linear_attn.g_a_proj.weight": "ssm_g_a.weight", "linear_attn.g_b_proj.weight": "ssm_g_b.weight",
    "linear_attn.o_norm.weight": "ssm_norm.weight",
    # gated DeltaNet with split projections (qwen35moe)
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    # Gemma-4's sandwich norms, per-layer output scale and router scales (its dense MLP is the names below)
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight", "layer_scalar": "layer_output_scale.weight",
    "mlp.router.input_scale": "ffn_gate_inp.scale", "mlp.router.expert_scale": "ffn_down_exps.scale",
    # a dense layer's MLP (DeepSeek-V3 / GLM's first layers)
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")  # deepseek2's split kv_b_proj
QKVZ_PARTS = ("attn_qkv.weight", "attn_gate.weight")  # qwen3next's split in_proj_qkvz
# norms a (1 + w) architecture stores as 1 + w (canonical names after "model.layers.{i}.", and the final norm)
PLUS_ONE_NORMS = frozenset({"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                            "self_attn.k_norm.weight", "model.norm.weight"})
PERMUTED_QK = {"self_attn.q_proj.weight": "num_heads", "self_attn.k_proj.weight": "num_kv_heads"}


def layer_of(name: str) -> tuple[int, str] | None:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``(3, "self_attn.q_proj.weight")``; None for a global name."""
    prefix, _, rest = name.partition(".layers.")
    if prefix != "model" or not rest:
        return None
    layer, _, rel = rest.partition(".")
    return (int(layer), rel) if layer.isdigit() else None


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row index that undoes llama.cpp's Q/K permutation: ``w_hf = w_gguf[index]``.

    The converter wrote ``w_gguf[h, i, j] = w_hf[h, j, i]`` with rows viewed as ``[heads, d/2, 2]``
    on its side and ``[heads, 2, d/2]`` on Hugging Face's."""
    if heads < 1 or rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of an even size")
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """``attn_k_b [H, kv_lora, nope]`` and ``attn_v_b [H, v, kv_lora]`` -> ``kv_b_proj [H * (nope + v), kv_lora]``."""
    heads, kv_lora, _ = k_b.shape
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, kv_lora)


def join_qkvz(qkv: torch.Tensor, z: torch.Tensor, num_k_heads: int, k_head_dim: int) -> torch.Tensor:
    """``attn_qkv [q | k | v, D]`` and ``attn_gate [z, D]`` -> Qwen3-Next's ``in_proj_qkvz``, whose rows
    hold q, k, v, z of key head 0, then those of key head 1, and so on."""
    d = qkv.shape[1]
    key = num_k_heads * k_head_dim
    q, k, v = qkv[:key], qkv[key:2 * key], qkv[2 * key:]
    per_head = [t.reshape(num_k_heads, -1, d) for t in (q, k, v, z)]
    return torch.cat(per_head, dim=1).reshape(-1, d)


def untile_v_heads(num_k_heads: int, per_key: int, head_dim: int) -> torch.Tensor:
    """The index that undoes llama.cpp's value-head reorder along one axis of ``num_k_heads * per_key``
    heads of ``head_dim``: stored ``[per_key, num_k_heads, head_dim]`` (tiled), Hugging Face's
    ``[num_k_heads, per_key, head_dim]`` (grouped by key head); ``w_hf = w_gguf[index]`` on that axis."""
    return torch.arange(num_k_heads * per_key * head_dim).view(per_key, num_k_heads, head_dim).transpose(0, 1).reshape(-1)
