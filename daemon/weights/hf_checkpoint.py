"""Read a Hugging Face model directory (config.json + *.safetensors) in moed's canonical form, a piece at a time.

Non-expert tensors keep their HF names (MoE parts renamed, see models/families.py) and are read
one by one in the checkpoint's dtype (float32, bf16 or fp16; anything else as float32); routed experts come as float32 k-major chunks of consecutive flat ids
(``gate_up [n, D, 2I]``, gate columns first, and ``down [n, I, D]``), so the converter and the
loader hold one chunk of experts at a time, never the whole pool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from moed.errors import ModelFormatError, quoted
from moed.models.families import Family, family_of, parse_model_config
from moed.models.model_config import ModelConfig
from moed.weights.expert_chunk import ExpertChunk
from moed.weights.file_checks import require_regular_file
from moed.weights.fp8_blocks import FP8_DTYPES, MXFP4_METHOD, SCALE_SUFFIX, dequantize_fp8_blocks, fp8_config_of
from moed.weights.safetensors_files import SafetensorsFiles

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
NATIVE_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_EXPERTS = 16  # experts per chunk: a Qwen3-30B-A3B chunk is 16 x 4.7 MB x 2 (fp32) = 150 MB


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


class HfCheckpoint:
    """One Hugging Face directory: config parsed, tensor names mapped; data read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.raw_config = read_config_json(self.path)
        where = str(self.path / "config.json")
        self.family: Family = family_of(self.raw_config, where=where)
        self.config: ModelConfig = parse_model_config(self.raw_config, where=where)
        self.fp8 = fp8_config_of(self.raw_config, where)
        quant = self.raw_config.get("quantization_config")
        self.is_mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == MXFP4_METHOD
        self.source = SafetensorsFiles(self.path)
        self.weight_keys = _canonical_keys(self.config, self.family, self.source.keys())  # canonical -> HF

    @property
    def num_bank_rows(self) -> int:
        return self.config.num_moe_layers * self.config.moe.num_experts

    def default_bank_dtype(self) -> str:
        """The bank dtype that holds the routed experts without loss, or with the least: MXFP4 experts
        stay mxfp4 (bit for bit); bf16 experts stay bf16; FP8 experts become bf16 (one rounding of
        fp8 x block scale, 1/16 of an FP8 step); fp16 and fp32 experts need fp32 to stay exact."""
        if self.is_mxfp4:
            return "mxfp4"
        if self.fp8 is not None:
            return "bf16"
        stored = self._expert_storage_dtype()
        return "bf16" if stored == torch.bfloat16 else "fp32"

    def _expert_storage_dtype(self) -> torch.dtype | None:
        names = self.family.names
        for layer in range(self.config.num_layers):
            if self.config.moe_layers[layer]:
                prefix = names.moe_prefix.format(i=layer) + "."
                key = prefix + (names.fused_down or names.expert_down.format(e=0))
                return self.source.dtype(key) if key in self.source else None
        return None

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.source.shape(key) for name, key in self.weight_keys.items()}

    def weight_dtype(self, name: str) -> torch.dtype:
        """The dtype a non-expert weight is kept in: the checkpoint's own when it is float32, bf16 or
        fp16 (computed with float32 accumulation, see layers/linear.py), bf16 for FP8 weights (their
        block scales applied), else float32."""
        stored = self.source.dtype(self.weight_keys[name])
        if stored in FP8_DTYPES:
            return torch.bfloat16
        return stored if stored in NATIVE_WEIGHT_DTYPES else torch.float32

    def read_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One non-expert weight, in ``dtype`` (default: ``weight_dtype(name)``)."""
        return self._read(self.weight_keys[name]).to(dtype or self.weight_dtype(name)).contiguous()

    def _read(self, key: str) -> torch.Tensor:
        """A tensor as float32 (FP8 block scales applied), or in its own dtype when that is bf16/fp16/fp32."""
        stored = self.source.dtype(key)
        if stored not in FP8_DTYPES:
            return self.source.get(key, None if stored in NATIVE_WEIGHT_DTYPES else torch.float32)
        scale_key = key + SCALE_SUFFIX
        if self.fp8 is None or scale_key not in self.source:
            raise ModelFormatError(
                f"{self.source.entries[key].file}: tensor {quoted(key)} is FP8 but "
                + ("config.json has no quantization_config" if self.fp8 is None else f"{quoted(scale_key)} is missing")
                + "; block-scaled FP8 needs both (is the checkpoint complete?)")
        return dequantize_fp8_blocks(self.source.get(key, None), self.source.get(scale_key), self.fp8.block,
                                     f"{self.source.entries[key].file}: {quoted(key)}")

    def expert_chunks(self, chunk_experts: int = CHUNK_EXPERTS, bank_dtype: str | None = None) -> Iterator[ExpertChunk]:
        """Every routed expert, in flat-id order, ``chunk_experts`` at a time (never across layers).
        MXFP4 experts come as packed mxfp4 bank rows (``bank_rows`` converts them if ``bank_dtype``
        is another dtype); everything else as float32."""
        config, names, moe = self.config, self.family.names, self.config.moe
        d, inter, num_experts = config.hidden_size, moe.intermediate_size, moe.num_experts
        for layer in range(config.num_layers):
            if not config.moe_layers[layer]:
                continue
            base = config.moe_layer_index(layer) * num_experts
            prefix = names.moe_prefix.format(i=layer) + "."
            if names.fused_gate_up and prefix + names.fused_gate_up + "_blocks" in self.source:
                yield from self._mxfp4_chunks(prefix, base, chunk_experts)
                continue
            if names.fused_gate_up:  # gpt-oss: one tensor per layer holds every expert
                fused = self._shaped(prefix + names.fused_gate_up, (num_experts, d, 2 * inter))
                gate_up = torch.cat([fused[..., 0::2], fused[..., 1::2]], dim=-1)  # interleaved -> gate | up
                del fused
                down = self._shaped(prefix + names.fused_down, (num_experts, inter, d))
                gub = db = None
                if moe.has_expert_bias:
                    bias = self._shaped(prefix + names.fused_gate_up + "_bias", (num_experts, 2 * inter))
                    gub = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
                    db = self._shaped(prefix + names.fused_down + "_bias", (num_experts, d))
                for e0 in range(0, num_experts, chunk_experts):
                    e1 = min(num_experts, e0 + chunk_experts)
                    yield ExpertChunk(base + e0, gate_up[e0:e1], down[e0:e1],
                                      None if gub is None else gub[e0:e1], None if db is None else db[e0:e1])
                continue
            for e0 in range(0, num_experts, chunk_experts):
                e1 = min(num_experts, e0 + chunk_experts)
                gate_up = torch.empty(e1 - e0, d, 2 * inter)
                down = torch.empty(e1 - e0, inter, d)
                for i, e in enumerate(range(e0, e1)):
                    gate_up[i, :, :inter] = self._shaped(prefix + names.expert_gate.format(e=e), (inter, d)).t()
                    gate_up[i, :, inter:] = self._shaped(prefix + names.expert_up.format(e=e), (inter, d)).t()
                    down[i] = self._shaped(prefix + names.expert_down.format(e=e), (d, inter)).t()
                yield ExpertChunk(base + e0, gate_up, down)

    def _mxfp4_chunks(self, prefix: str, base: int, chunk_experts: int) -> Iterator[ExpertChunk]:
        """gpt-oss MXFP4 experts of one layer: ``*_blocks [E, rows, K/32, 16]`` + ``*_scales [E, rows, K/32]``
        repacked bit for bit into mxfp4 bank rows (gate_up's interleaved gate/up rows reordered to
        gate | up, the order of every bank)."""
        from moed.kernels.mxfp4_format import from_gpt_oss_blocks

        names, moe = self.family.names, self.config.moe
        d, inter, num_experts = self.config.hidden_size, moe.intermediate_size, moe.num_experts
        gu, dn = prefix + names.fused_gate_up, prefix + names.fused_down
        if not self.is_mxfp4:
            raise ModelFormatError(f"{self.path}: {quoted(gu + '_blocks')} holds MXFP4 experts but config.json's "
                                   "quantization_config is not mxfp4; the config and the weights do not belong together")
        order = torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)])  # interleaved -> gate | up
        gu_blocks = self._packed(gu + "_blocks", (num_experts, 2 * inter, d // 32, 16))[:, order]
        gu_scales = self._packed(gu + "_scales", (num_experts, 2 * inter, d // 32))[:, order]
        dn_blocks = self._packed(dn + "_blocks", (num_experts, d, inter // 32, 16))
        dn_scales = self._packed(dn + "_scales", (num_experts, d, inter // 32))
        gub = db = None
        if moe.has_expert_bias:
            bias = self._shaped(gu + "_bias", (num_experts, 2 * inter))
            gub = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
            db = self._shaped(dn + "_bias", (num_experts, d))
        for e0 in range(0, num_experts, chunk_experts):
            e1 = min(num_experts, e0 + chunk_experts)
            gu_fp4, gu_e8m0 = from_gpt_oss_blocks(gu_blocks[e0:e1].contiguous(), gu_scales[e0:e1].contiguous())
            dn_fp4, dn_e8m0 = from_gpt_oss_blocks(dn_blocks[e0:e1].contiguous(), dn_scales[e0:e1].contiguous())
            packed = {"gate_up.fp4": gu_fp4, "gate_up.e8m0": gu_e8m0, "down.fp4": dn_fp4, "down.e8m0": dn_e8m0}
            yield ExpertChunk(base + e0, gate_up_bias=None if gub is None else gub[e0:e1],
                              down_bias=None if db is None else db[e0:e1], packed=packed, packed_dtype="mxfp4")

    def _packed(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A uint8 tensor of packed MXFP4 data, shape checked against the config."""
        if key not in self.source:
            raise ModelFormatError(f"{self.path}: MXFP4 expert tensor {quoted(key)} is missing (config.json expects "
                                   f"shape {list(shape)}); is the checkpoint complete?")
        got, dtype = self.source.shape(key), self.source.dtype(key)
        if got != shape or dtype != torch.uint8:
            raise ModelFormatError(f"{self.path}: MXFP4 tensor {quoted(key)} is {dtype} {list(got)} but config.json "
                                   f"implies uint8 {list(shape)}; the config and the weights do not belong together")
        return self.source.get(key, None)

    def _shaped(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in self.source:
            raise ModelFormatError(
                f"{self.path}: expert tensor {quoted(key)} is missing (config.json expects shape {list(shape)})")
        got = self.source.shape(key)
        if got != shape:
            raise ModelFormatError(
                f"{self.path}: tensor {quoted(key)} has shape {list(got)} but config.json implies {list(shape)}; "
                "the config and the weights do not belong together")
        return self._read(key).float()


def _canonical_keys(config: ModelConfig, family: Family, keys: list[str]) -> dict[str, str]:
    """Canonical non-expert weight name -> the HF tensor that holds it (routed experts excluded)."""
    names = family.names
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
    mapping: dict[str, str] = {}
    for key in keys:
        if names.skip_prefixes and key.startswith(names.skip_prefixes):
            continue  # a vision tower, multi-token prediction: not used for text generation
        hf_key = key
        if names.language_prefix and key.startswith(names.language_prefix):
            key = "model." + key[len(names.language_prefix):]  # its canonical name
        match = _LAYER.match(key)
        layer = int(match.group(1)) if match else None
        if layer is not None and layer >= config.num_layers:
            continue  # e.g. DeepSeek's multi-token-prediction layers: not used for generation
        if key.endswith("rotary_emb.inv_freq") or key.endswith(SCALE_SUFFIX):
            continue  # FP8 block scales are read with their weights
        if layer is not None and config.moe_layers[layer]:
            prefix = names.moe_prefix.format(i=layer) + "."
            if hf_key.startswith(prefix):
                rel = hf_key[len(prefix):]
                if rel in renames:
                    mapping[f"model.layers.{layer}.mlp.{renames[rel]}"] = hf_key
                # routed experts (rel starts with "experts.") are read by expert_chunks
                continue
        mapping[key] = hf_key
    return mapping
