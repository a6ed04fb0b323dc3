"""A chunk of consecutive bank rows as a checkpoint reader yields it, and its conversion to a bank dtype.

Readers yield either float32 k-major matrices (``gate_up [n, D, 2I]``, gate columns first, and
``down [n, I, D]``) or rows already packed in one of the bank's layouts (``packed``, see
cache/host_bank.py), when the source's own quantisation is one the bank can hold without loss
(gpt-oss MXFP4 -> mxfp4, GGUF Q8_0 -> q8). ``bank_rows`` turns either into the rows of the bank
dtype the user chose: packed rows pass through untouched when the dtypes match, and are
dequantised to float32 and converted otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moed.cache.bank_builder import convert_expert_rows, dequantize_bank_rows


@dataclass(frozen=True)
class ExpertChunk:
    """Bank rows ``start .. start + n`` (flat ids ``moe_layer * E + expert``)."""

    start: int
    gate_up: torch.Tensor | None = None  # float32 [n, D, 2I] (None when packed)
    down: torch.Tensor | None = None  # float32 [n, I, D]
    gate_up_bias: torch.Tensor | None = None  # float32 [n, 2I]
    down_bias: torch.Tensor | None = None  # float32 [n, D]
    packed: Mapping[str, torch.Tensor] | None = None  # bank tensors (no biases) of these rows
    packed_dtype: str | None = None  # the bank dtype ``packed`` is laid out in

    def __post_init__(self) -> None:
        if (self.packed is None) == (self.gate_up is None):
            raise ValueError("an expert chunk holds either float32 gate_up/down or packed bank rows")
        if (self.packed is None) != (self.packed_dtype is None):
            raise ValueError("packed rows need their packed_dtype")

    @property
    def num_rows(self) -> int:
        if self.gate_up is not None:
            return self.gate_up.shape[0]
        return next(iter(self.packed.values())).shape[0]


def bank_rows(chunk: ExpertChunk, dtype: str) -> dict[str, torch.Tensor]:
    """The chunk's rows in bank dtype ``dtype`` (name -> tensor, biases included)."""
    if chunk.packed is not None and chunk.packed_dtype == dtype:
        rows = dict(chunk.packed)
        if chunk.gate_up_bias is not None and chunk.down_bias is not None:
            rows["gate_up_bias"] = chunk.gate_up_bias.contiguous()
            rows["down_bias"] = chunk.down_bias.contiguous()
        return rows
    if chunk.packed is not None:
        gate_up, down = dequantize_bank_rows(dict(chunk.packed), chunk.packed_dtype)
    else:
        gate_up, down = chunk.gate_up, chunk.down
    return convert_expert_rows(gate_up, down, dtype, chunk.gate_up_bias, chunk.down_bias)
