"""Read a Hugging Face model directory (config.json + *.safetensors) into moed's canonical form.

Non-expert tensors keep their HF names (MoE parts renamed, see models/families.py) and become
float32; routed experts are gathered into float32 k-major stacks ``gate_up [N, D, 2I]`` and
``down [N, I, D]`` in flat-id order, ready for ``build_expert_bank``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moed.errors import ModelFormatError
from moed.weights.file_checks import require_regular_file
from moed.models.families import Family, family_of, parse_model_config
from moed.models.model_config import ModelConfig


@dataclass
class DenseCheckpoint:
    """A checkpoint in canonical form with experts still as float32 stacks."""

    config: ModelConfig
    raw_config: dict
    weights: dict[str, torch.Tensor]
    gate_up: torch.Tensor | None  # [N, D, 2I] f32, gate columns first
    down: torch.Tensor | None  # [N, I, D] f32
    gate_up_bias: torch.Tensor | None = None  # [N, 2I]
    down_bias: torch.Tensor | None = None  # [N, D]


def read_config_json(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file() and not file.exists():
        raise ModelFormatError(f"{path}: no config.json found; is this a Hugging Face model directory?")
    require_regular_file(file)
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{file}: expected a JSON object")
    return cfg


class _TensorSource:
    """All tensors of the directory's safetensors files, opened lazily."""

    def __init__(self, path: Path) -> None:
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise ModelFormatError(f"{path}: no *.safetensors weight files found")
        self.location: dict[str, Path] = {}
        self.handles = {}
        for file in self.files:
            require_regular_file(file)
        for file in self.files:
            try:
                handle = safe_open(str(file), "pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise ModelFormatError(f"{file}: cannot read safetensors file ({exc}); the file is corrupt or truncated") from None
            self.handles[file] = handle
            for key in handle.keys():
                self.location[key] = file

    def keys(self) -> list[str]:
        return list(self.location)

    def get(self, key: str) -> torch.Tensor:
        file = self.location.get(key)
        if file is None:
            raise ModelFormatError(f"tensor {key!r} not found in any *.safetensors file of {self.files[0].parent}")
        try:
            return self.handles[file].get_tensor(key).to(torch.float32)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelFormatError(f"{file}: cannot read tensor {key!r} ({exc}); the file is corrupt or truncated") from None


def load_hf_checkpoint(path: str | Path) -> DenseCheckpoint:
    path = Path(path)
    raw = read_config_json(path)
    family = family_of(raw, where=str(path / "config.json"))
    config = parse_model_config(raw, where=str(path / "config.json"))
    source = _TensorSource(path)
    weights, experts = _canonical_weights(config, family, source)
    gate_up, down, gate_up_bias, down_bias = _expert_stacks(config, family, source, experts, path)
    return DenseCheckpoint(config, raw, weights, gate_up, down, gate_up_bias, down_bias)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _canonical_weights(config: ModelConfig, family: Family, source: _TensorSource):
    names = family.names
    weights: dict[str, torch.Tensor] = {}
    experts: dict[int, list[str]] = {}
    renames = {names.router + ".weight": "router.weight"}
    if names.router_bias:
        renames[names.router_bias] = "router.bias"
    if names.score_bias:
        renames[names.score_bias] = "router.score_bias"
    if names.shared:
        for part in ("gate_proj", "up_proj", "down_proj"):
            renames[f"{names.shared}.{part}.weight"] = f"shared.{part}.weight"
    if names.shared_gate:
        renames[names.shared_gate + ".weight"] = "shared_gate.weight"
    for key in source.keys():
        match = _LAYER.match(key)
        layer = int(match.group(1)) if match else None
        if layer is not None and layer >= config.num_layers:
            continue  # e.g. DeepSeek's multi-token-prediction layers: not used for generation
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if layer is not None and config.moe_layers[layer]:
            prefix = names.moe_prefix.format(i=layer) + "."
            if key.startswith(prefix):
                rel = key[len(prefix):]
                if rel in renames:
                    weights[f"model.layers.{layer}.mlp.{renames[rel]}"] = source.get(key)
                elif rel.startswith("experts."):
                    experts.setdefault(layer, []).append(key)
                continue
        weights[key] = source.get(key)
    return weights, experts


def _expert_stacks(config: ModelConfig, family: Family, source: _TensorSource, found: dict[int, list[str]], path: Path):
    moe = config.moe
    if config.num_moe_layers == 0:
        return None, None, None, None
    d, inter, num_experts = config.hidden_size, moe.intermediate_size, moe.num_experts
    n = config.num_moe_layers * num_experts
    gate_up = torch.empty(n, d, 2 * inter)
    down = torch.empty(n, inter, d)
    gate_up_bias = torch.empty(n, 2 * inter) if moe.has_expert_bias else None
    down_bias = torch.empty(n, d) if moe.has_expert_bias else None
    names = family.names
    for layer in range(config.num_layers):
        if not config.moe_layers[layer]:
            continue
        base = config.moe_layer_index(layer) * num_experts
        prefix = names.moe_prefix.format(i=layer) + "."
        if names.fused_gate_up:
            fused = _shaped(source, prefix + names.fused_gate_up, (num_experts, d, 2 * inter), path)
            gate_up[base : base + num_experts] = torch.cat([fused[..., 0::2], fused[..., 1::2]], dim=-1)
            down[base : base + num_experts] = _shaped(source, prefix + names.fused_down, (num_experts, inter, d), path)
            if moe.has_expert_bias:
                bias = _shaped(source, prefix + names.fused_gate_up + "_bias", (num_experts, 2 * inter), path)
                gate_up_bias[base : base + num_experts] = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
                down_bias[base : base + num_experts] = _shaped(
                    source, prefix + names.fused_down + "_bias", (num_experts, d), path)
            continue
        for e in range(num_experts):
            gate = _shaped(source, prefix + names.expert_gate.format(e=e), (inter, d), path)
            up = _shaped(source, prefix + names.expert_up.format(e=e), (inter, d), path)
            gate_up[base + e] = torch.cat([gate.t(), up.t()], dim=1)
            down[base + e] = _shaped(source, prefix + names.expert_down.format(e=e), (d, inter), path).t()
    return gate_up, down, gate_up_bias, down_bias


def _shaped(source: _TensorSource, key: str, shape: tuple[int, ...], path: Path) -> torch.Tensor:
    if key not in source.location:
        raise ModelFormatError(f"{path}: expert tensor {key!r} is missing (config.json expects shape {list(shape)})")
    tensor = source.get(key)
    if tuple(tensor.shape) != shape:
        raise ModelFormatError(
            f"{path}: tensor {key!r} has shape {list(tensor.shape)} but config.json implies {list(shape)}; "
            "the config and the weights do not belong together"
        )
    return tensor
