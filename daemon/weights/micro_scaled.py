"""Hugging Face checkpoints whose Linear weights are NVFP4 or MXFP8 (kernels/nvfp4_format.py).

Which producers and layouts (per quantised Linear ``X``):

- llm-compressor / compressed-tensors, ``quantization_config.quant_method = "compressed-tensors"``:
  ``nvfp4-pack-quantized``: ``X.weight_packed`` uint8 ``[N, K/2]``, ``X.weight_scale``
  float8_e4m3fn ``[N, K/16]``, ``X.weight_global_scale`` float32 ``[1]``;
  ``mxfp8-quantized``: ``X.weight`` float8_e4m3fn ``[N, K]``, ``X.weight_scale`` uint8 ``[N, K/32]``.
- NVIDIA ModelOpt NVFP4, ``quant_method = "modelopt"`` with ``quant_algo = "NVFP4"`` in
  config.json or in ``hf_quant_config.json``'s ``quantization``: ``X.weight`` uint8 ``[N, K/2]``,
  ``X.weight_scale`` float8_e4m3fn ``[N, K/16]``, ``X.weight_scale_2`` float32 scalar.

Which tensors are quantised is read from the tensors themselves (the data with its scales beside
it), not from the config's ignore lists; activation scales (``input_scale``, ``input_global_scale``)
are read and not used: moed computes with its own activations (int8 or bf16), as weight-only
kernels on GPUs without FP4 units do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moed.errors import ModelFormatError, UnsupportedModelError, quoted
from moed.kernels.fp8_block_format import mxfp8_rows
from moed.kernels.nvfp4_format import (GGML_NVFP4_BLOCK, MXFP8_GROUP, NVFP4_GROUP, dequantize_mxfp8,
                                       dequantize_nvfp4, to_ggml_nvfp4)
from moed.weights.safetensors_files import SafetensorsFiles

CT_METHOD = "compressed-tensors"
MODELOPT_METHOD = "modelopt"
CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp8-quantized": "mxfp8"}
NOT_QUANTISED = ("dense",)  # a compressed-tensors group left as it was
# tensors beside a quantised weight that are read with it, or not at all
COMPANIONS = (".weight_scale", ".weight_global_scale", ".weight_scale_2", ".input_scale", ".input_global_scale",
              ".weight_zero_point", ".k_scale", ".v_scale")


@dataclass(frozen=True)
class MicroScaled:
    """The NVFP4 or MXFP8 layout of one checkpoint."""

    kind: str  # "nvfp4" | "mxfp8"
    producer: str  # CT_METHOD | MODELOPT_METHOD

    @property
    def label(self) -> str:
        return f"{self.kind.upper()} ({self.producer})"

    def data_key(self, key: str) -> str:
        """The tensor that holds a Linear weight's data: ``X.weight_packed`` for compressed-tensors NVFP4."""
        if self.kind == "nvfp4" and self.producer == CT_METHOD and key.endswith(".weight"):
            return key + "_packed"
        return key

    def canonical(self, key: str) -> str | None:
        """A stored tensor's weight name (``X.weight`` for ``X.weight_packed``), or None for a companion."""
        if key.endswith(COMPANIONS):
            return None
        if key.endswith(".weight_packed"):
            return key[:-len("_packed")]
        return key

    def is_quantised(self, source: SafetensorsFiles, key: str) -> bool:
        """Whether ``key`` (a data key) is a quantised weight of this layout: its scales are beside it."""
        base = key[:-len("_packed")] if key.endswith(".weight_packed") else key
        if not base.endswith(".weight") or key not in source or base + "_scale" not in source:
            return False
        stored = source.dtype(key)
        return stored == (torch.uint8 if self.kind == "nvfp4" else torch.float8_e4m3fn)

    def shape(self, source: SafetensorsFiles, key: str) -> tuple[int, ...]:
        """The weight's logical shape ``(N, K)`` (NVFP4 data holds two weights a byte)."""
        n, k = source.shape(key)
        return (n, 2 * k) if self.kind == "nvfp4" else (n, k)

    def read(self, source: SafetensorsFiles, key: str) -> torch.Tensor:
        """A quantised weight dequantised to float32 ``[N, K]``, by the format's reference."""
        base = key[:-len("_packed")] if key.endswith(".weight_packed") else key
        data, scale = self._checked(source, key, base)
        if self.kind == "mxfp8":
            return dequantize_mxfp8(data, scale)
        if self.producer == CT_METHOD:
            return dequantize_nvfp4(data, scale, divided_by=self._scalar(source, base + "_global_scale"))
        return dequantize_nvfp4(data, scale, times=self._scalar(source, base + "_scale_2"))

    def ggml_rows(self, source: SafetensorsFiles, keys: list[str], out: torch.Tensor) -> torch.Tensor:
        """NVFP4 weights of one shape (a layer's experts of one kind) as llama.cpp NVFP4 rows into ``out``
        ``uint8 [len(keys), N, K/64 * 36]``, the same values without loss; returns the float32 factor
        each one's outputs take (1/g, or ModelOpt's s2), ``[len(keys)]``."""
        n, k = self.shape(source, keys[0])
        data = torch.empty(len(keys), n, k // 2, dtype=torch.uint8)
        scales = torch.empty(len(keys), n, k // NVFP4_GROUP, dtype=torch.float8_e4m3fn)
        factors = torch.empty(len(keys), dtype=torch.float32)
        for i, key in enumerate(keys):
            base = key[:-len("_packed")] if key.endswith(".weight_packed") else key
            data[i], scales[i] = self._checked(source, key, base)
            if self.producer == CT_METHOD:
                factors[i] = 1.0 / self._scalar(source, base + "_global_scale").float()
            else:
                factors[i] = self._scalar(source, base + "_scale_2")
        try:
            to_ggml_nvfp4(data.view(-1, k // 2), scales.view(-1, k // NVFP4_GROUP), out.view(len(keys) * n, -1))
        except ValueError as exc:
            raise ModelFormatError(f"{source.path}: {quoted(keys[0].rsplit('.', 3)[0])}: {exc}") from None
        return factors

    def mxfp8_rows(self, source: SafetensorsFiles, key: str, out: torch.Tensor) -> None:
        """One MXFP8 weight moved into moed's MXFP8 rows ``out`` ``uint8 [N, K/32 * 33]`` (kernels/fp8_block_format.py),
        the same values without loss."""
        codes, scales = self._checked(source, key, key)
        mxfp8_rows(codes, scales, out)

    def _checked(self, source: SafetensorsFiles, key: str, base: str) -> tuple[torch.Tensor, torch.Tensor]:
        where = f"{source.entries[key].file}: {quoted(key)}"
        n, k = self.shape(source, key)
        group = NVFP4_GROUP if self.kind == "nvfp4" else MXFP8_GROUP
        scale_dtype = torch.float8_e4m3fn if self.kind == "nvfp4" else torch.uint8
        scale_key = base + "_scale"
        if k % group or source.shape(scale_key) != (n, k // group) or source.dtype(scale_key) != scale_dtype:
            raise ModelFormatError(
                f"{where}: a {self.label} weight of shape [{n}, {k}] needs {quoted(scale_key)} {scale_dtype} "
                f"[{n}, {k // group}], got {source.dtype(scale_key)} {list(source.shape(scale_key))}")
        return source.get(key, None), source.get(scale_key, None)

    @staticmethod
    def _scalar(source: SafetensorsFiles, key: str) -> torch.Tensor:
        if key not in source:
            raise ModelFormatError(f"{source.path}: {quoted(key)} is missing; an NVFP4 weight needs its per-tensor "
                                   "scale (is the checkpoint complete?)")
        value = source.get(key, torch.float32).reshape(-1)
        if value.numel() != 1 or not bool(torch.isfinite(value).all()) or float(value[0]) == 0.0:
            raise ModelFormatError(f"{source.path}: {quoted(key)} must be one finite, non-zero float, got "
                                   f"{value.tolist()[:4]}")
        return value[0]


def micro_scaled_of(raw_config: dict, path: Path, where: str) -> MicroScaled | None:
    """The checkpoint's NVFP4 / MXFP8 layout, None when it has neither; an error naming what is not supported."""
    q = raw_config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == CT_METHOD:
        formats = {g.get("format", q.get("format")) for g in (q.get("config_groups") or {}).values()
                   if isinstance(g, dict)} or {q.get("format")}
        kinds = {CT_FORMATS.get(f) for f in formats if f not in NOT_QUANTISED}
        if len(kinds) != 1 or None in kinds:
            raise UnsupportedModelError(
                f"{where}: compressed-tensors format(s) {sorted(str(f) for f in formats)} are not supported "
                f"(supported: {', '.join(CT_FORMATS)}, one per checkpoint)")
        return MicroScaled(kinds.pop(), CT_METHOD)
    algo = q.get("quant_algo") if isinstance(q, dict) and method == MODELOPT_METHOD else None
    side = path / "hf_quant_config.json"
    if algo is None and (method == MODELOPT_METHOD or q is None) and side.is_file():
        try:
            algo = json.loads(side.read_text()).get("quantization", {}).get("quant_algo")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelFormatError(f"{side}: not a ModelOpt quantization file ({exc})") from None
        if algo is None and method is None:
            return None
    if algo is None and method != MODELOPT_METHOD:
        return None
    if algo != "NVFP4":
        raise UnsupportedModelError(f"{where}: ModelOpt quant_algo {quoted(algo)} is not supported (supported: NVFP4)")
    return MicroScaled("nvfp4", MODELOPT_METHOD)


def keeps_ggml_rows(k: int) -> bool:
    """Whether NVFP4 rows of ``k`` weights fill whole llama.cpp blocks (the ggml bank keeps them)."""
    return k % GGML_NVFP4_BLOCK == 0
