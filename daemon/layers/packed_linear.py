"""PackedLinear: a Linear weight kept in a bank matrix format (q8 or int4) instead of bf16.

A GGUF file's quantised attention / lm_head / shared-expert weights load into this (see
weights/gguf_checkpoint.py) so that decode reads 4.5-8.5 bits per weight, as llama.cpp does,
rather than the 16 of a bf16 dequantisation. The matrix is held k-major, ``w [K, N]`` (the
transpose of torch's Linear weight ``[N, K]``), in the layouts of kernels/q8_format.py
(``qs`` int8 [K, N], ``d`` float16 [K/32, N]) and kernels/int4_format.py (``q`` uint8 [K, N/2],
``scale``/``min`` bf16 [K/32, N]).

``matmul`` runs the native kernel (int8-quantised activations per 32, like llama.cpp's Q8
activations) for 1..MAX_TOKENS rows; for more rows (prefill), or without the native library, it
dequantises to float32 with the torch reference and multiplies in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moed.kernels.int4_format import dequantize_int4
from moed.kernels.native_cpu import MAX_TOKENS, native
from moed.kernels.q8_format import dequantize_q8

GROUP = 32  # weights per scale along K, both formats
PACKED_DTYPES = ("q8", "int4")


def packed_shapes(dtype: str, k: int, n: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The (shape, dtype) of each array of a ``[K, N]`` matrix in ``dtype``, in ``arrays`` order."""
    if dtype == "q8":
        return ((k, n), torch.int8), ((k // GROUP, n), torch.float16)
    if dtype == "int4":
        return ((k, n // 2), torch.uint8), ((k // GROUP, n), torch.bfloat16), ((k // GROUP, n), torch.bfloat16)
    raise ValueError(f"packed linear dtype {dtype!r} is not one of {', '.join(PACKED_DTYPES)}")


def packed_nbytes(dtype: str, k: int, n: int) -> int:
    """Bytes a ``[K, N]`` matrix takes in ``dtype`` (what ``PackedLinear.nbytes`` returns): the load
    estimate (weights/checkpoint.py) counts this before anything is read."""
    total = 0
    for shape, tdtype in packed_shapes(dtype, k, n):
        numel = 1
        for s in shape:
            numel *= s
        total += numel * tdtype.itemsize
    return total


def can_pack(k: int, n: int) -> bool:
    """Whether a ``[N, K]`` Linear weight fits the packed formats and the native kernel."""
    return k > 0 and n > 0 and k % GROUP == 0 and n % 2 == 0


def weight_nbytes(weight: "torch.Tensor | PackedLinear") -> int:
    """Host bytes of one loaded weight, a tensor or a PackedLinear (memory figures, fit checks)."""
    if isinstance(weight, PackedLinear):
        return weight.nbytes()
    return weight.numel() * weight.element_size()


@dataclass(frozen=True, eq=False)
class PackedLinear:
    """Stands in for a Linear weight ``[out_features, in_features]`` stored packed as ``w [K, N]``."""

    dtype: str  # "q8" | "int4"
    arrays: tuple[torch.Tensor, ...]  # q8: (qs, d); int4: (q, scale, min)
    in_features: int  # K
    out_features: int  # N

    def __post_init__(self) -> None:
        k, n = self.in_features, self.out_features
        if not can_pack(k, n):
            raise ValueError(f"packed linear [{n}, {k}]: K must be a multiple of {GROUP} and N even")
        want = packed_shapes(self.dtype, k, n)
        if len(self.arrays) != len(want):
            raise ValueError(f"packed linear {self.dtype}: {len(want)} arrays expected, got {len(self.arrays)}")
        for t, (shape, tdtype) in zip(self.arrays, want):
            if tuple(t.shape) != shape or t.dtype != tdtype or not t.is_contiguous():
                raise ValueError(f"packed linear {self.dtype} [{n}, {k}]: array should be contiguous {tdtype} "
                                 f"{list(shape)}, got {t.dtype} {list(t.shape)}")

    @property
    def shape(self) -> torch.Size:
        """``(N, K)``, a Linear weight's shape (so shape checks treat both alike)."""
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.arrays[0].device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.arrays)

    def _dequantized_kn(self) -> torch.Tensor:
        """float32 ``[K, N]`` (exact: the formats' products fit float32)."""
        if self.dtype == "q8":
            return dequantize_q8(*self.arrays)
        return dequantize_int4(*self.arrays)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as a Linear weight ``[N, K]`` in ``dtype`` (contiguous)."""
        return self._dequantized_kn().t().to(dtype).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` -> ``x @ w`` float32 ``[T, N]``."""
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"packed linear: x must be [T, {self.in_features}], got {tuple(x.shape)}")
        x = x.float()
        rows = x.shape[0]
        if 0 < rows <= MAX_TOKENS and x.device.type == "cpu" and self.device.type == "cpu":
            lib = native()
            if lib is not None:
                return lib.matmul(self.dtype, self.arrays, self.in_features, self.out_features, x.contiguous())
        w = self._dequantized_kn().to(x.device)
        if rows > MAX_TOKENS:
            # prefill: a bf16 GEMM (twice the speed of float32 here), activations rounded to bf16 like
            # every bf16 projection's (layers/linear.py)
            return (x.to(torch.bfloat16) @ w.to(torch.bfloat16)).float()
        return x @ w
