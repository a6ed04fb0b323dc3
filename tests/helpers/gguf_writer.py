"""Writes tiny transformers MoE models as GGUF files in llama.cpp's layout, for tests.

What convert_hf_to_gguf.py (llama.cpp) would write for Qwen3-MoE, Qwen2-MoE and gpt-oss: its tensor
names (gguf-py's tensor_mapping), its metadata keys, its float32 rules (1-D tensors, norms,
biases and routers stay F32) and the tokenizer metadata of the tiny test tokenizer. Expert and
other 2-D weights are quantised with ``gguf.quants`` (F32/F16/BF16/Q8_0/Q4_0/Q4_1/MXFP4); the
K-quants, which gguf.quants cannot quantise, and the IQ types are written as random blocks
(``random_blocks``) so tests can compare dequantisation with the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from tokenizers import Tokenizer

from helpers.tiny_models import build_tiny_model, tiny_config
from helpers.tiny_tokenizer import EOS_TOKEN, write_tiny_tokenizer

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "gpt_oss": "gpt-oss"}
FAMILIES = tuple(GGUF_ARCH)
_QUANTISABLE = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4)


def build_gguf_ready_model(family: str, dst: Path, *, seed: int = 0, scale: float = 4.0, **overrides):
    """tiny_models' ``family`` model, changed only where llama.cpp cannot represent it: every
    qwen2_moe layer is MoE (llama.cpp's qwen2moe has no dense layers) and eos is the tiny
    tokenizer's (llama.cpp's converter takes eos from the tokenizer). ``overrides`` set config
    fields (e.g. ``hidden_size=256`` so rows hold whole 256-weight K-quant blocks). Saved with the
    tokenizer as a Hugging Face directory at ``dst``; returns the transformers model."""
    config = tiny_config(family)
    if family == "qwen2_moe":
        config.mlp_only_layers = []
    for key, value in overrides.items():
        setattr(config, key, value)
    tokenizer_dir = write_tiny_tokenizer(dst)
    config.eos_token_id = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(EOS_TOKEN)
    return build_tiny_model(family, dst, seed=seed, scale=scale, config=config)


def gguf_tensors(model, family: str) -> dict[str, np.ndarray]:
    """llama.cpp name -> float32 numpy array (numpy shape = the GGUF ne reversed)."""
    return {name: t.contiguous().numpy() for name, t in gguf_views(model, family).items()}


def gguf_views(model, family: str) -> dict[str, torch.Tensor]:
    """llama.cpp name -> a view into ``model``'s (float32) parameters in that tensor's layout: writing
    into a view writes the parameter, which is how tests load GGUF-dequantised values back into
    the transformers model that serves as the reference."""
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    cfg = model.config
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[h + "input_layernorm.weight"]
        post = "post_attention_norm" if family == "gpt_oss" else "ffn_norm"
        out[b + post + ".weight"] = sd[h + "post_attention_layernorm.weight"]
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            for part in ("weight", "bias"):
                if f"{h}self_attn.{hf}.{part}" in sd:
                    out[f"{b}{gg}.{part}"] = sd[f"{h}self_attn.{hf}.{part}"]
        for hf, gg in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            if f"{h}self_attn.{hf}.weight" in sd:
                out[f"{b}{gg}.weight"] = sd[f"{h}self_attn.{hf}.weight"]
        if family == "gpt_oss":
            out[b + "attn_sinks.weight"] = sd[h + "self_attn.sinks"]
            out[b + "ffn_gate_inp.weight"] = sd[h + "mlp.router.weight"]
            out[b + "ffn_gate_inp.bias"] = sd[h + "mlp.router.bias"]
            gate_up = sd[h + "mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, D], gate/up rows interleaved
            out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = gate_up[:, 0::2], gate_up[:, 1::2]
            out[b + "ffn_down_exps.weight"] = sd[h + "mlp.experts.down_proj"].transpose(1, 2)  # [E, D, I]
            bias = sd[h + "mlp.experts.gate_up_proj_bias"]
            out[b + "ffn_gate_exps.bias"], out[b + "ffn_up_exps.bias"] = bias[:, 0::2], bias[:, 1::2]
            out[b + "ffn_down_exps.bias"] = sd[h + "mlp.experts.down_proj_bias"]
            continue
        out[b + "ffn_gate_inp.weight"] = sd[h + "mlp.gate.weight"]
        gate_up = sd[h + "mlp.experts.gate_up_proj"]  # [E, 2I, D], gate rows first
        inter = gate_up.shape[1] // 2
        out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = gate_up[:, :inter], gate_up[:, inter:]
        out[b + "ffn_down_exps.weight"] = sd[h + "mlp.experts.down_proj"]  # [E, D, I]
        if family == "qwen2_moe":
            for part in ("gate", "up", "down"):
                out[f"{b}ffn_{part}_shexp.weight"] = sd[f"{h}mlp.shared_expert.{part}_proj.weight"]
            out[b + "ffn_gate_inp_shexp.weight"] = sd[h + "mlp.shared_expert_gate.weight"]  # [1, D]
    return out


def load_dequantised_into(model, family: str, path: Path) -> None:
    """Overwrite ``model``'s weights with the GGUF file's tensors as ``gguf.quants`` dequantises them
    (the reference for moed's reading of the same file)."""
    views = gguf_views(model, family)
    reader = gguf.GGUFReader(str(path))
    with torch.no_grad():
        for tensor in reader.tensors:
            values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
            view = views[tensor.name]
            view.copy_(torch.from_numpy(np.array(values, dtype=np.float32)).reshape(view.shape))


def is_expert_tensor(name: str) -> bool:
    return name.endswith("_exps.weight")


def stays_f32(name: str, array: np.ndarray) -> bool:
    """llama.cpp's rule: 1-D tensors, norms, biases and the routers are never quantised."""
    return (array.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or ".ffn_gate_inp" in name)


def random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks of ``qtype`` for a tensor of numpy ``shape``: ``uint8 [..., bytes]``
    with every fp16 scale a finite small positive value."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % elems:
        raise ValueError(f"{qtype.name} needs rows of whole {elems}-weight blocks; shape {shape} has {shape[-1]}")
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // elems, size), dtype=np.uint8)
    # fp16 scale fields: (byte offset, count) per type
    scales = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208, 1), T.Q2_K: (80, 2), T.Q3_K: (108, 1), T.Q4_1: (0, 2),
              T.Q5_1: (0, 2)}.get(qtype, (0, 1))
    start, count = scales
    values = rng.uniform(0.001, 0.02, size=(blocks.shape[0], count)).astype(np.float16)
    blocks[:, start:start + 2 * count] = values.view(np.uint8)
    if qtype == T.NVFP4:  # four unsigned E4M3 scales per block, 2^-4 .. 2^1 (bit 7 random: ignored)
        blocks[:, 0:4] = rng.integers(24, 64, size=(blocks.shape[0], 4)) | (rng.integers(0, 2, size=(blocks.shape[0], 4)) << 7)
    return blocks.reshape(*shape[:-1], shape[-1] // elems * size)


def encode(name: str, array: np.ndarray, qtype: T, rng: np.random.Generator) -> tuple[np.ndarray, T]:
    """The bytes (or float array) GGUFWriter.add_tensor takes for ``array`` stored as ``qtype``."""
    if qtype == T.F32:
        return array.astype(np.float32), T.F32
    if qtype in _QUANTISABLE:
        return gguf.quants.quantize(array.astype(np.float32), qtype), qtype
    return random_blocks(qtype, array.shape, rng), qtype


def write_gguf(model, family: str, path: Path, tokenizer_dir: Path, *, expert_type: T = T.F32,
               weight_type: T = T.F32, tensor_types: dict[str, T] | None = None, seed: int = 0,
               drop: tuple[str, ...] = (), tokenizer_pre: str = "gpt-2", split_max_tensors: int = 0) -> Path:
    """``model`` as the GGUF file llama.cpp would write, experts in ``expert_type``, other 2-D weights
    in ``weight_type``; ``tensor_types`` overrides single tensors (a K-quant or IQ type gets
    random blocks); tensors named in ``drop`` are left out; ``tokenizer_pre`` is written as
    tokenizer.ggml.pre (the tiny tokenizer's own split is GPT-2's, "gpt-2"); ``split_max_tensors``
    splits the file as gguf-split does (``path``'s stem + ``-00001-of-0000N.gguf`` ...)."""
    arch = GGUF_ARCH[family]
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_config(writer, cfg, family)
    write_tokenizer_metadata(writer, tokenizer_dir, cfg.vocab_size, pre=tokenizer_pre)
    rng = np.random.default_rng(seed)
    for name, array in gguf_tensors(model, family).items():
        if name in drop:
            continue
        qtype = (tensor_types or {}).get(name)
        if qtype is None:
            qtype = T.F32 if stays_f32(name, array) else expert_type if is_expert_tensor(name) else weight_type
        data, raw_type = encode(name, array, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=None if raw_type in (T.F32, T.F16) else raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(family: str, root: Path, *, expert_type: T = T.F32, weight_type: T = T.F32,
                    tensor_types: dict[str, T] | None = None, seed: int = 0, **overrides):
    """``root/hf`` (the Hugging Face directory) and ``root/model.gguf`` of one tiny model (config
    ``overrides`` as build_gguf_ready_model takes them); returns (gguf path, hf dir, transformers model)."""
    hf_dir = root / "hf"
    model = build_gguf_ready_model(family, hf_dir, seed=seed, **overrides)
    path = write_gguf(model, family, root / "model.gguf", hf_dir, expert_type=expert_type,
                      weight_type=weight_type, tensor_types=tensor_types, seed=seed)
    return path, hf_dir, model


def write_bare_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, T | None]] | None = None,
                    metadata: dict[str, object] | None = None, tokenizer_dir: Path | None = None,
                    tokenizer_pre: str = "gpt-2") -> Path:
    """A GGUF with the given architecture, metadata and tensors only (for error and tokenizer
    tests); with ``tokenizer_dir``, that tokenizer's metadata too."""
    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer_dir is not None:
        write_tokenizer_metadata(writer, tokenizer_dir, 0, pre=tokenizer_pre)
    for key, value in (metadata or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (data, raw_type) in (tensors or {"token_embd.weight": (np.zeros((4, 32), np.float32), None)}).items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_config(w: gguf.GGUFWriter, cfg, family: str) -> None:
    """The hyper-parameters convert_hf_to_gguf.py's TextModel (+ the family's model class) writes."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = dict(cfg.rope_parameters or {})
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts if family == "gpt_oss" else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.to_dict().get("head_dim") is not None:  # Qwen2-MoE's config has none
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if family == "gpt_oss":
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
    else:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def write_tokenizer_metadata(w: gguf.GGUFWriter, tokenizer_dir: Path, vocab_size: int, *, pre: str = "gpt-2") -> None:
    """What convert_hf_to_gguf.py's _set_vocab_gpt2 + SpecialVocab write for a byte-level BPE
    tokenizer directory (the tiny tokenizer), the vocabulary padded to ``vocab_size``."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    added = {t["id"]: t for t in tok["added_tokens"]}
    by_id = {i: s for s, i in tok["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    tokens, types = [], []
    for i in range(max(vocab_size, max(by_id) + 1)):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        types.append(gguf.TokenType.NORMAL if i not in added else
                     gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    ids = {tok_str: i for i, tok_str in by_id.items()}
    for key, adder in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                       ("pad_token", w.add_pad_token_id), ("unk_token", w.add_unk_token_id)):
        if config.get(key) in ids:
            adder(ids[config[key]])
    w.add_add_bos_token(bool(config.get("add_bos_token", False)))
    w.add_add_eos_token(bool(config.get("add_eos_token", False)))
    if config.get("chat_template"):
        w.add_chat_template(config["chat_template"])
