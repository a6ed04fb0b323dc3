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
    # MoE
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.router.score_bias": "exp_probs_b.bias",
    "mlp.shared.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared.down_proj.weight": "ffn_down_shexp.weight", "mlp.shared_gate.weight": "ffn_gate_inp_shexp.weight",
    # a dense layer's MLP (DeepSeek-V3 / GLM's first layers)
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")  # deepseek2's split kv_b_proj
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
