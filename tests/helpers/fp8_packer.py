"""Write a block-scaled FP8 checkpoint (DeepSeek-V3 / Qwen3-FP8 layout) from a float model, for tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """float ``w [out, in]`` -> (float8_e4m3fn ``[out, in]``, float32 ``scale_inv [ceil(out/bo), ceil(in/bi)]``)."""
    out_dim, in_dim = w.shape
    bo, bi = block
    rows, cols = -(-out_dim // bo), -(-in_dim // bi)
    scale_inv = torch.empty(rows, cols)
    q = torch.empty(out_dim, in_dim, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].double()
            s = max(tile.abs().max().item() / FP8_MAX, 1e-12)
            scale_inv[r, c] = s
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (tile / s).float().to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize_reference(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Element by element in float64, written independently of moed's dequantiser."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for j0 in range(0, q.shape[1], block[1]):
            out[i, j0:j0 + block[1]] = q[i, j0:j0 + block[1]].double() * float(scale_inv[i // block[0], j0 // block[1]])
    return out


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """What the real releases quantize: 2-D linear weights, not embeddings, lm_head, norms or the router."""
    return (t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "lm_head" not in name
            and "norm" not in name and not name.endswith("mlp.gate.weight"))


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """Quantize ``src`` (an HF dir of float weights) into ``dst``; returns the dequantized state dict
    (float32), i.e. the weights a reference run must use."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if is_quantized(name, t):
            q, s = quantize_fp8_blocks(t.float(), block)
            out[name], out[name + "_scale_inv"] = q, s
            dequantized[name] = dequantize_reference(q, s, block).float()
        else:
            out[name] = t
            dequantized[name] = t.float()
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    return dequantized
