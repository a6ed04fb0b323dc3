"""Rows of GGUF blocks kept as the file stores them (the "ggml" expert bank, native/cpu/ggml_rows.h).

A matrix ``[rows, K]`` is ``uint8 [rows, row_bytes]``: each row the GGUF tensor's blocks for that
row, byte for byte (llama.cpp's block structs), so a GGUF expert tensor ``[E, rows, K]`` is ``E``
such matrices back to back and loads with one read, without decoding. The kernels multiply the
blocks directly with int8 activations; ``dequantize_rows`` (gguf_quants.py, bit for bit
``gguf.quants``) is the reference for what a row holds, and ``rows_product_reference`` the torch
twin of the kernels: the same int8 activations times the decoded rows, in float64.
"""

from __future__ import annotations

import torch

from moed.kernels.native_cpu_reference import quantize_activations
from moed.kernels import gguf_quants as q
from moed.kernels import ggml_x8_format as x8

# the GGUF types the ggml bank keeps (the kernels in native/cpu/ggml_rows.c read each)
ROW_TYPES: tuple[int, ...] = (q.Q8_0, q.Q4_0, q.Q4_1, q.Q5_0, q.Q5_1, q.Q2_K, q.Q3_K, q.Q4_K, q.Q5_K, q.Q6_K,
                              q.IQ4_NL, q.IQ4_XS, q.MXFP4, q.NVFP4, q.FP8_B128, q.MXFP8)
# the GGUF types among them (what a GGUF file's tensors may be; FP8_B128 / MXFP8 are moed's own,
# kernels/fp8_block_format.py, for FP8 checkpoints)
GGUF_ROW_TYPES: tuple[int, ...] = tuple(t for t in ROW_TYPES if t not in q.MOED_TYPES)


# the row types a PackedLinear keeps by name (the type's name in lower case: "q4_k", "mxfp8" ...; layers/packed_linear.py).
# Q8_0 is left out: a linear keeps it as "q8", the same codes and scales in moed's q8 rows layout
LINEAR_TYPES: dict[str, int] = {q.type_name(t).lower(): t for t in ROW_TYPES if t != q.Q8_0}


# values per activation scale the kernels of a type need (native/cpu/ggml_rows.h, moed_ggml_act_span):
# the K-quants' AVX-512 VNNI kernels sum a super-block in integers, so its activations share one scale
ACT_SPAN: dict[int, int] = {q.Q2_K: 256, q.Q3_K: 256, q.Q4_K: 256, q.Q5_K: 256, q.Q6_K: 256}


def act_span(ggml_type: int) -> int:
    """32, or 256 for the types whose kernels take one activation scale per super-block (an x8 layout: its
    GGUF type's)."""
    return ACT_SPAN.get(x8.base_type(ggml_type), 32)


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of ``k`` weights of ``ggml_type`` (``k`` whole blocks; an x8 layout's rows are its GGUF
    type's)."""
    ggml_type = x8.base_type(ggml_type)
    weights, size = q.block_size(ggml_type)
    if k < 1 or k % weights:
        raise ValueError(f"{q.type_name(ggml_type)} rows need a multiple of {weights} weights, got {k}")
    return k // weights * size


def check_rows(raw: torch.Tensor, ggml_type: int, k: int, what: str = "rows") -> int:
    """``raw`` is ``uint8 [rows, row_bytes]`` of a type the bank keeps; returns the row count."""
    if ggml_type not in ROW_TYPES:
        raise ValueError(f"{what}: the ggml bank keeps {', '.join(q.type_name(t) for t in ROW_TYPES)}, "
                         f"not {q.type_name(ggml_type)}")
    want = row_bytes(ggml_type, k)
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != want:
        raise ValueError(f"{what}: {q.type_name(ggml_type)} rows of {k} weights must be uint8 [rows, {want}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return raw.shape[0]


def dequantize_rows(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
    """``uint8 [rows, row_bytes]`` -> float32 ``[rows, k]``, what gguf.quants decodes (an x8 matrix: its GGUF
    rows, unpacked by the torch twin of the layout)."""
    if x8.is_x8(ggml_type):
        return dequantize_rows(x8.unpack(raw, ggml_type, k), x8.base_type(ggml_type), k)
    rows = check_rows(raw, ggml_type, k)
    return q.dequantize(raw.reshape(-1), ggml_type, (rows, k))


def rows_product_reference(raw: torch.Tensor, ggml_type: int, k: int, x: torch.Tensor, span: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' product ``x [T, k] @ rows.T`` computed in float64 from the same int8 activations (the
    float ones for moed's FP8 types)
    (quantised with ``span`` values per scale: the type's ``act_span`` unless given; a call on several
    matrices quantises once with the largest of theirs):
    ``(y [T, rows], bound [T, rows])``, ``bound`` the sum of the absolute terms (a kernel agrees within
    ~1e-5 of it: only its float32 summation order differs)."""
    w = dequantize_rows(raw, ggml_type, k).double()  # [rows, k]
    if int(ggml_type) in q.MOED_TYPES:  # the FP8 types' kernels read the float activations themselves
        xa = x.double()
        return xa @ w.T, xa.abs() @ w.abs().T
    xq, xs, _ = quantize_activations(x.float(), span or act_span(ggml_type))
    xa = (xq.double().reshape(x.shape[0], -1, 32) * xs.double()[..., None]).reshape(x.shape[0], k)
    return xa @ w.T, xa.abs() @ w.abs().T
