"""Which reader a model path needs (Hugging Face directory, GGUF file), and what loading it will cost.

FTW directories are moed's own converted form and are loaded by model_loader directly; the two
source formats are read through checkpoint objects with one interface (``HfCheckpoint``,
``GgufCheckpoint``): config, non-expert weights one at a time, routed experts a chunk at a time,
and the bank dtype that keeps the experts' own precision (``default_bank_dtype``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch

from moed.cache.bank_builder import bank_tensor_specs
from moed.cache.expert_dtypes import GGML_BANK
from moed.cache.host_bank import EXPERT_DTYPES
from moed.cache.kv_cache import kv_dtype_for
from moed.errors import ModelFormatError
from moed.layers.packed_linear import packed_nbytes
from moed.weights.hf_checkpoint import CHUNK_EXPERTS, HfCheckpoint

FTW_INDEX = "ftw.json"

if TYPE_CHECKING:  # imported lazily: it needs the gguf package
    from moed.weights.gguf_checkpoint import GgufCheckpoint

Checkpoint = Union[HfCheckpoint, "GgufCheckpoint"]


def is_ftw_dir(path: Path) -> bool:
    return (path / FTW_INDEX).is_file()


def source_kind(path: str | Path) -> str:
    """ "ftw", "hf" or "gguf" for a model path; a one-line ModelFormatError for anything else."""
    path = Path(path)
    if path.is_dir():
        if is_ftw_dir(path):
            return "ftw"
        if (path / "config.json").exists():
            return "hf"
        raise ModelFormatError(f"{path}: neither {FTW_INDEX} (moed FTW) nor config.json (Hugging Face) found; "
                               "point --model at a model directory or a .gguf file")
    if path.exists():
        from moed.weights.gguf_file import is_gguf_file

        if is_gguf_file(path):
            return "gguf"
        raise ModelFormatError(f"{path}: not a model directory and not a GGUF file (no GGUF magic); point --model "
                               "at a Hugging Face or FTW directory or a .gguf file")
    raise ModelFormatError(f"{path}: model directory or file not found")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The reader for a Hugging Face directory or a GGUF file (headers parsed, no tensor data read)."""
    kind = source_kind(path)
    if kind == "hf":
        return HfCheckpoint(path)
    if kind == "gguf":
        from moed.weights.gguf_checkpoint import GgufCheckpoint

        return GgufCheckpoint(path)
    raise ModelFormatError(f"{path} is already an FTW model; convert from the Hugging Face directory or GGUF file")


@dataclass(frozen=True)
class LoadBytes:
    """Host RAM a load from a checkpoint needs at its peak, from headers only."""

    weight_bytes: int  # non-expert weights in their run-time dtype
    bank_bytes: int  # the expert bank in ``bank_dtype``
    working_bytes: int  # one chunk of experts in float32 + the largest weight being converted
    bank_dtype: str
    bank_bytes_by_dtype: dict[str, int]  # every bank dtype this model can be stored in
    kv_dtype: torch.dtype = torch.bfloat16  # the K/V the model will keep (cache/kv_cache.kv_dtype_for)

    @property
    def total(self) -> int:
        return self.weight_bytes + self.bank_bytes + self.working_bytes


def checkpoint_load_bytes(checkpoint: Checkpoint, experts_dtype: str | None, weights_dtype: str = "auto") -> LoadBytes:
    config, moe = checkpoint.config, checkpoint.config.moe
    d, inter = config.hidden_size, moe.intermediate_size
    weights = largest = 0
    # GGUF: quantised linear() weights load packed (model_loader._read_run_weight) unless fp32 is asked for
    packed = getattr(checkpoint, "packed_weight_dtype", None) if weights_dtype == "auto" else None
    for name, shape in checkpoint.weight_shapes().items():
        numel = math.prod(shape)
        target = packed(name) if packed is not None else None
        if target is not None:
            weights += packed_nbytes(target, shape[1], shape[0])  # Linear [N, K] held as w [K, N]
        else:
            dtype = torch.float32 if weights_dtype == "fp32" else checkpoint.weight_dtype(name)
            weights += numel * dtype.itemsize
        largest = max(largest, numel * 4)  # dequantised to float32 while it is read (packed or not)
    by_dtype = {}
    for dtype in EXPERT_DTYPES:
        if dtype in ("int4", "q8", "mxfp4") and (d % 32 or inter % 32):
            continue
        specs = bank_tensor_specs(dtype, checkpoint.num_bank_rows, d, inter, moe.has_expert_bias)
        by_dtype[dtype] = sum(math.prod(shape) * tdtype.itemsize for shape, tdtype in specs.values())
    ggml_nbytes = checkpoint.ggml_bank_nbytes()  # a GGUF file's expert tensors as stored, an NVFP4 checkpoint's
    if ggml_nbytes is not None:
        by_dtype[GGML_BANK] = ggml_nbytes
    bank_dtype = experts_dtype or checkpoint.default_bank_dtype()
    chunk = min(CHUNK_EXPERTS, moe.num_experts) * 3 * d * inter * 4 * 2  # float32 rows + their conversion
    embed = "model.embed_tokens.weight"
    run_dtype = torch.float32 if weights_dtype == "fp32" else (
        None if packed is not None and packed(embed) is not None else checkpoint.weight_dtype(embed))
    return LoadBytes(weights, by_dtype.get(bank_dtype, 0), chunk + largest, bank_dtype, by_dtype, kv_dtype_for(run_dtype))

