"""PackedLinear: a Linear weight kept in a bank matrix format (q8 or int4), as a block-scaled FP8
checkpoint stores it (fp8), or as GGUF blocks (a GGUF type's name in lower case: "q4_k", "q6_k",
"iq4_xs", "nvfp4", ...: llama.cpp's rows, byte for byte, and a float32 factor every output takes),
instead of bf16.

A GGUF file's quantised attention / lm_head / shared-expert weights load into this in their own
type (see weights/gguf_checkpoint.py; Q8_0 as q8, the same bits), so decode reads 2.6-8.5 bits per
weight, as llama.cpp does, rather than the 16 of a bf16 dequantisation; an NVFP4 checkpoint's
linears are "nvfp4" rows with the tensor's global scale as the factor. The matrix is held row by
row like torch's Linear weight ``[N, K]``, in the rows layouts of kernels/rows_format.py (q8: ``qs``
int8 [N, K], ``d`` float16 [N, K/32]; int4: ``q`` uint8 [N, K/2], ``scale``/``min`` bf16 [N, K/32];
GGUF types: uint8 [N, row_bytes], kernels/ggml_rows_format.py): a GEMV then streams each row front
to back. ``from_kn`` takes the k-major arrays the bank repackers make.

``matmul`` runs the native kernel (int8-quantised activations per 32, like llama.cpp's Q8
activations) for 1..MAX_TOKENS rows (``matmul_many``: q, k and v in one call); for more rows
(prefill), or without the native library, it dequantises with the torch reference and
multiplies in bf16 (prefill) or float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moed.kernels.native_cpu import MAX_TOKENS, native
from moed.kernels.prefill_gemm import prefill_gemm_dtype
from moed.kernels import ggml_rows_format
from moed.kernels import gguf_quants as q
from moed.kernels.rows_format import FP8_BLOCK, dequantize_rows, rows_from_kn, rows_shapes

GROUP = 32  # weights per scale along K, q8 and int4 (fp8: FP8_BLOCK; GGUF types: their block)
NVFP4_BLOCK = 64  # weights of one llama.cpp NVFP4 block (36 bytes)
# GGUF block types kept as stored: dtype name (the type's name in lower case) -> GGML type id. Q8_0 is
# "q8" (its rows layout holds the same codes and fp16 scales, and the decode chain's q8 kernels read it)
GGML_LINEAR: dict[str, int] = ggml_rows_format.LINEAR_TYPES
PACKED_DTYPES = ("q8", "int4", "fp8", *GGML_LINEAR)


def ggml_linear_dtype(ggml_type: int) -> str | None:
    """The PackedLinear dtype that keeps GGUF type ``ggml_type`` as stored, or None."""
    name = q.type_name(ggml_type).lower()
    return name if GGML_LINEAR.get(name) == ggml_type else None


def packed_shapes(dtype: str, k: int, n: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The (shape, dtype) of each array of a ``[N, K]`` weight in ``dtype``, in ``arrays`` order."""
    if dtype not in PACKED_DTYPES:
        raise ValueError(f"packed linear dtype {dtype!r} is not one of {', '.join(PACKED_DTYPES)}")
    if dtype in GGML_LINEAR:  # the rows as llama.cpp stores them, and the factor every output takes
        return ((n, ggml_rows_format.row_bytes(GGML_LINEAR[dtype], k)), torch.uint8), ((1,), torch.float32)
    return rows_shapes(dtype, k, n)


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


def can_pack(k: int, n: int, dtype: str = "q8") -> bool:
    """Whether a ``[N, K]`` Linear weight fits the packed format ``dtype`` and the native kernel."""
    if dtype == "fp8":
        return k > 0 and n > 0 and k % FP8_BLOCK == 0
    if dtype in GGML_LINEAR:
        return k > 0 and n > 0 and k % q.block_size(GGML_LINEAR[dtype])[0] == 0
    if dtype not in PACKED_DTYPES:
        return False
    return k > 0 and n > 0 and k % GROUP == 0 and n % 2 == 0


def weight_nbytes(weight: "torch.Tensor | PackedLinear") -> int:
    """Host bytes of one loaded weight, a tensor or a PackedLinear (memory figures, fit checks)."""
    if isinstance(weight, PackedLinear):
        return weight.nbytes()
    return weight.numel() * weight.element_size()


@dataclass(frozen=True, eq=False)
class PackedLinear:
    """Stands in for a Linear weight ``[out_features, in_features]`` stored packed, row by row."""

    dtype: str  # "q8" | "int4" | "fp8" | a GGML_LINEAR name
    # rows layout; q8: (qs, d); int4: (q, scale, min); fp8: (codes, scale); GGUF types: (rows, factor)
    arrays: tuple[torch.Tensor, ...]
    in_features: int  # K
    out_features: int  # N

    def __post_init__(self) -> None:
        k, n = self.in_features, self.out_features
        if not can_pack(k, n, self.dtype):
            if self.dtype not in PACKED_DTYPES:
                raise ValueError(f"packed linear dtype {self.dtype!r} is not one of {', '.join(PACKED_DTYPES)}")
            block = q.block_size(GGML_LINEAR[self.dtype])[0] if self.dtype in GGML_LINEAR else None
            raise ValueError(f"packed linear {self.dtype} [{n}, {k}]: K must be a multiple of "
                             + (f"{block}" if block else f"{FP8_BLOCK}" if self.dtype == "fp8" else f"{GROUP} and N even"))
        want = packed_shapes(self.dtype, k, n)
        if len(self.arrays) != len(want):
            raise ValueError(f"packed linear {self.dtype}: {len(want)} arrays expected, got {len(self.arrays)}")
        for t, (shape, tdtype) in zip(self.arrays, want):
            if tuple(t.shape) != shape or t.dtype != tdtype or not t.is_contiguous():
                raise ValueError(f"packed linear {self.dtype} [{n}, {k}]: array should be contiguous {tdtype} "
                                 f"{list(shape)}, got {t.dtype} {list(t.shape)}")

    @classmethod
    def from_kn(cls, dtype: str, arrays: tuple[torch.Tensor, ...], in_features: int, out_features: int
                ) -> "PackedLinear":
        """From the k-major arrays of ``w [K, N]`` (kernels/q8_format.py, int4_format.py), moved exactly."""
        if dtype not in PACKED_DTYPES:
            raise ValueError(f"packed linear dtype {dtype!r} is not one of {', '.join(PACKED_DTYPES)}")
        return cls(dtype, rows_from_kn(dtype, arrays), in_features, out_features)

    @property
    def shape(self) -> torch.Size:
        """``(N, K)``, a Linear weight's shape (so shape checks treat both alike)."""
        return torch.Size((self.out_features, self.in_features))

    @property
    def ggml_type(self) -> int | None:
        """The GGML type id of a weight kept as GGUF rows, else None."""
        return GGML_LINEAR.get(self.dtype)

    @property
    def device(self) -> torch.device:
        return self.arrays[0].device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.arrays)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight as a Linear weight ``[N, K]`` in ``dtype`` (contiguous; float32 is exact but for nvfp4's
        factor, one float32 multiply)."""
        if self.ggml_type is not None:
            w = ggml_rows_format.dequantize_rows(self.arrays[0], self.ggml_type, self.in_features) * self.arrays[1]
            return w.to(dtype).contiguous()
        return dequantize_rows(self.dtype, self.arrays, dtype)

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the weight, decoded exactly to float32 ``[*ids.shape, K]``: an
        embedding table kept packed (a GGUF file's token_embd in its own type, as llama.cpp's get_rows
        reads it) looks up only the rows a batch needs."""
        flat = ids.reshape(-1).to(self.device)
        if self.ggml_type is not None:
            rows = ggml_rows_format.dequantize_rows(self.arrays[0][flat].contiguous(), self.ggml_type, self.in_features)
            rows = rows if float(self.arrays[1]) == 1.0 else rows * self.arrays[1]
        elif self.dtype in ("q8", "int4", "fp8"):
            rows = dequantize_rows(self.dtype, tuple(a[flat] for a in self.arrays), torch.float32)
        else:
            raise ValueError(f"packed linear {self.dtype}: no row lookup")
        return rows.view(*ids.shape, self.in_features)

    def dequantize_bf16(self) -> torch.Tensor:
        """``dequantize(torch.bfloat16)``, by the native library when there is one (the same bits,
        on all cores: prefill dequantises every projection once per chunk)."""
        lib = native()
        if lib is not None and self.device.type == "cpu":
            if self.ggml_type is not None:  # the values times the factor, rounded once more to bf16 (exact for 1)
                rows = lib.ggml_to_bf16(self.arrays[0], self.ggml_type, self.in_features)
                return rows if float(self.arrays[1]) == 1.0 else (rows.float() * self.arrays[1]).bfloat16()
            return lib.rows_to_bf16(self.dtype, self.arrays, self.in_features)
        return self.dequantize(torch.bfloat16)

    def dequantize_f32(self) -> torch.Tensor:
        """``dequantize(torch.float32)``, by the native library when there is one (the same bits, on all cores
        and about 20x faster than the torch decoders: CPUs without native bf16 GEMMs dequantise every
        projection to float32 once per prefill chunk)."""
        lib = native()
        if lib is not None and self.device.type == "cpu":
            if self.ggml_type is not None:
                rows = lib.ggml_to_f32(self.arrays[0], self.ggml_type, self.in_features)
                return rows if float(self.arrays[1]) == 1.0 else rows * self.arrays[1]
            return lib.rows_to_f32(self.dtype, self.arrays, self.in_features)
        return self.dequantize(torch.float32)

    @property
    def _kernel(self) -> str:
        """Which native kernel multiplies it: weights of one kernel share a call (and its quantised x)."""
        return "ggml" if self.ggml_type is not None else self.dtype

    def _native_ok(self, x: torch.Tensor) -> bool:
        return 0 < x.shape[0] <= MAX_TOKENS and x.device.type == "cpu" and self.device.type == "cpu" \
            and native() is not None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` -> ``x @ w.T`` float32 ``[T, N]``."""
        return self.matmul_many((self,), x)[0]

    @staticmethod
    def matmul_many(weights: "tuple[PackedLinear, ...]", x: torch.Tensor) -> list[torch.Tensor]:
        """``[w.matmul(x) for w in weights]``, one native call when they share a dtype (q, k, v)."""
        first = weights[0]
        if x.dim() != 2 or any(w.in_features != x.shape[1] for w in weights):
            raise ValueError(f"packed linear: x must be [T, {first.in_features}], got {tuple(x.shape)}")
        x = x.float()
        if first._native_ok(x) and all(w.device.type == "cpu" for w in weights):
            if any(w._kernel != first._kernel for w in weights):  # one call per weight, as the decode chain does
                return [PackedLinear.matmul_many((w,), x)[0] for w in weights]
            if first.ggml_type is not None:
                # GGUF rows (ggml_rows.c; types may differ, x is quantised once), then each tensor's factor
                ys = native().ggml_rows([(w.arrays[0], w.ggml_type) for w in weights], x.contiguous())
                return [y if float(w.arrays[1]) == 1.0 else y * w.arrays[1] for y, w in zip(ys, weights)]
            return native().rows_many(first.dtype, [w.arrays for w in weights], x.contiguous())
        if x.shape[0] > MAX_TOKENS and prefill_gemm_dtype(torch.bfloat16, x.device) == torch.bfloat16:
            # prefill where the CPU has a native bf16 GEMM (twice the speed of float32 there; else
            # float32, kernels/prefill_gemm.py), activations rounded to bf16 like every bf16
            # projection's (layers/linear.py)
            xb = x.to(torch.bfloat16)
            return [F.linear(xb, w.dequantize_bf16().to(x.device)).float() for w in weights]
        return [F.linear(x, w.dequantize_f32().to(x.device)) for w in weights]
