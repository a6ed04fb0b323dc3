"""A checkpoint known from its config.json alone: the tensors the config implies, for planning (`moed fit`).

It answers the questions ``checkpoint.checkpoint_load_bytes`` asks a real checkpoint (non-expert tensor
shapes and dtypes, the expert bank's rows and default dtype) from the config: the shapes are the ones
``models/weight_spec.py`` checks a real load against, the dtypes the ones the config's ``torch_dtype`` /
``dtype`` and ``quantization_config`` name (FP8 and NVFP4 linears run as bf16, MXFP4 experts stay mxfp4,
NVFP4 experts keep their blocks in the ggml bank on the CPU, an MLA model's FP8 linears stay FP8 on the CPU),
as ``HfCheckpoint`` would decide them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moed.kernels.rows_format import FP8_BLOCK
from moed.layers.packed_linear import can_pack
from moed.models.families import family_of, parse_model_config
from moed.models.weight_spec import expected_weight_shapes
from moed.weights.hf_checkpoint import FP8_KEPT_LINEARS, ggml_bank_bytes
from moed.weights.micro_scaled import keeps_ggml_rows, micro_scaled_of


class ConfigOnlyCheckpoint:
    def __init__(self, raw: dict, *, where: str = "config.json", path: Path | None = None) -> None:
        self.raw, self.where = raw, where
        self.family = family_of(raw, where=where)
        self.config = parse_model_config(raw, where=where)
        q = raw.get("quantization_config")
        self.quant_method = q.get("quant_method") if isinstance(q, dict) else None
        self.micro = micro_scaled_of(raw, path or Path("/nonexistent"), where)
        stored = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
        self._dtype = torch.float32 if stored in ("float32", "float") else torch.bfloat16
        self.keep_fp8 = ""  # the packed kind a CPU-only plan keeps ("fp8", "nvfp4", "mxfp8"), "" for none

    def keep_fp8_linears(self, keep: bool) -> None:
        """As ``HfCheckpoint.keep_fp8_linears``: the FP8 (128-wide blocks), NVFP4 and MXFP8 linears stay as stored
        on the CPU."""
        q = self.raw.get("quantization_config")
        block = q.get("weight_block_size", [128, 128]) if isinstance(q, dict) else None
        fp8 = self.quant_method == "fp8" and isinstance(block, list) and len(block) == 2 and block[1] == FP8_BLOCK
        micro = self.micro.kind if self.micro is not None else ""  # "nvfp4" / "mxfp8" linears keep their rows
        self.keep_fp8 = "fp8" if bool(keep) and fp8 else micro if bool(keep) else ""

    def packed_weight_dtype(self, name: str) -> str | None:
        if not self.keep_fp8:
            return None
        rel = name.partition(".layers.")[2].partition(".")[2] if ".layers." in name else None
        shape = self.weight_shapes().get(name)
        kind = self.keep_fp8
        return kind if rel in FP8_KEPT_LINEARS and shape and can_pack(shape[1], shape[0], kind) else None

    @property
    def num_bank_rows(self) -> int:
        return self.config.num_moe_layers * self.config.moe.num_experts

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return expected_weight_shapes(self.config)

    def weight_dtype(self, name: str) -> torch.dtype:
        return self._dtype

    def _ggml_kind(self) -> str | None:
        """``HfCheckpoint._ggml_kind`` from the config: NVFP4, 128-wide block FP8 or MXFP8 experts in whole blocks
        (a config cannot say whether the experts are the quantised tensors; the published ones are)."""
        d, inter = self.config.hidden_size, self.config.moe.intermediate_size
        if self.micro is not None:
            if self.micro.kind == "nvfp4":
                return "nvfp4" if keeps_ggml_rows(d) and keeps_ggml_rows(inter) else None
            return "mxfp8" if d % 32 == 0 and inter % 32 == 0 else None
        q = self.raw.get("quantization_config")
        block = q.get("weight_block_size", [128, 128]) if isinstance(q, dict) else None
        if self.quant_method == "fp8" and isinstance(block, list) and len(block) == 2 and block[1] == FP8_BLOCK \
                and d % FP8_BLOCK == 0 and inter % FP8_BLOCK == 0 and self._expert_dtype() in (None, "fp8"):
            return "fp8"
        return None

    def prefers_ggml(self) -> bool:
        return self._ggml_kind() is not None

    def ggml_bank_nbytes(self) -> int | None:
        kind = self._ggml_kind()
        return None if kind is None else ggml_bank_bytes(kind, self.config, self.num_bank_rows)

    def _expert_dtype(self) -> str | None:
        """DeepSeek-V4's ``quantization_config.expert_dtype`` ("fp4": MXFP4 experts beside FP8 linears), or None."""
        q = self.raw.get("quantization_config")
        value = q.get("expert_dtype") if isinstance(q, dict) else self.raw.get("expert_dtype")
        return str(value).lower() if value else None

    def default_bank_dtype(self) -> str:
        """``HfCheckpoint.default_bank_dtype``'s choice for the checkpoint this config describes."""
        if self.quant_method == "mxfp4" or self._expert_dtype() in ("fp4", "mxfp4"):
            return "mxfp4"
        if self.micro is not None:
            return "bf16" if self.micro.kind == "mxfp8" else "int4"
        if self.quant_method == "fp8":
            return "bf16"
        return "fp32" if self._dtype == torch.float32 else "bf16"
