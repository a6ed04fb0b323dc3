"""Row-major ("rows") layouts of the q8 and int4 formats, for dense projections and the lm_head.

The expert bank keeps matrices k-major (``w [K, N]``, kernels/q8_format.py, kernels/int4_format.py);
a PackedLinear weight (layers/packed_linear.py) is multiplied alone, one row of ``[N, K]`` after
the other, so it is stored row by row (native/cpu/rows_quant.c):

- q8:   ``qs`` int8 ``[N, K]``, ``d`` float16 ``[N, K/32]``; ``w[n, k] = qs[n, k] * d[n, k // 32]``
- int4: ``q`` uint8 ``[N, K/2]``, ``scale``/``min`` bf16 ``[N, K/32]``; byte ``b`` of group ``g``
  (16 bytes per 32 weights) holds ``k = 32 g + b`` in its low nibble and ``32 g + 16 + b`` in its
  high nibble (llama.cpp's Q4_0/Q4_1 order); ``w[n, k] = code * scale + min``.

- fp8:  ``codes`` uint8 ``[N, K]`` (float8_e4m3fn bits), ``scale`` float32 ``[N, K/128]``; ``w[n, k] =
  e4m3(codes[n, k]) * scale[n, k // 128]`` (a block-scaled FP8 checkpoint's weight as stored, its
  128 x 128 block scales repeated per row: native/cpu/rows_fp8.c; no k-major form).

The conversions to and from the k-major arrays are exact (the same codes and scales, moved), done
a slice of rows at a time so a 49152-row lm_head never needs more than a few MB of temporaries.
"""

from __future__ import annotations

import torch

GROUP = 32
FP8_BLOCK = 128  # weights per FP8 scale along K
ROWS_DTYPES = ("q8", "int4", "fp8")
_SLICE = 4096  # rows converted at a time


def rows_shapes(dtype: str, k: int, n: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The (shape, dtype) of each array of an ``[N, K]`` matrix in the rows layout of ``dtype``."""
    if dtype == "q8":
        return ((n, k), torch.int8), ((n, k // GROUP), torch.float16)
    if dtype == "int4":
        return ((n, k // 2), torch.uint8), ((n, k // GROUP), torch.bfloat16), ((n, k // GROUP), torch.bfloat16)
    if dtype == "fp8":
        return ((n, k), torch.uint8), ((n, k // FP8_BLOCK), torch.float32)
    raise ValueError(f"rows layout dtype {dtype!r} is not one of {', '.join(ROWS_DTYPES)}")


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes uint8 ``[R, K]`` -> rows bytes ``[R, K/2]``."""
    r, k = codes.shape
    g = codes.reshape(r, k // GROUP, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(r, k // 2)


def _unpack_rows(q: torch.Tensor) -> torch.Tensor:
    """rows bytes uint8 ``[R, K/2]`` -> codes ``[R, K]``."""
    r, half = q.shape
    g = q.reshape(r, half // 16, 1, 16)
    return torch.cat([g & 0x0F, g >> 4], dim=2).reshape(r, half * 2)


def _kn_codes(q: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
    """Columns ``[j0, j1)`` of a k-major int4 matrix's codes, ``[K, j1 - j0]`` (``j1 <= N/2`` or ``j0 >= N/2``)."""
    half = q.shape[1]
    return q[:, j0:j1] & 0x0F if j1 <= half else q[:, j0 - half:j1 - half] >> 4


def _transposed(arrays: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.t().contiguous() for t in arrays)


def _check(dtype: str) -> None:
    if dtype not in ROWS_DTYPES:
        raise ValueError(f"rows layout dtype {dtype!r} is not one of {', '.join(ROWS_DTYPES)}")


def _check_kn(dtype: str) -> None:
    _check(dtype)
    if dtype == "fp8":
        raise ValueError("the fp8 rows layout has no k-major form")


def rows_from_kn(dtype: str, arrays: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """k-major arrays of one ``[K, N]`` matrix -> its rows-layout arrays (the same numbers)."""
    _check_kn(dtype)
    if dtype == "q8":  # (qs, d): plain transposes
        return _transposed(arrays)
    q, scale, mn = arrays
    k, n = q.shape[0], q.shape[1] * 2
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    half = n // 2
    for lo, hi in ((0, half), (half, n)):  # a slice never straddles the two nibbles
        for j0 in range(lo, hi, _SLICE):
            j1 = min(hi, j0 + _SLICE)
            out[j0:j1] = _pack_rows(_kn_codes(q, j0, j1).t().contiguous())
    return (out, *_transposed((scale, mn)))


def rows_to_kn(dtype: str, arrays: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The inverse of ``rows_from_kn``."""
    _check_kn(dtype)
    if dtype == "q8":
        return _transposed(arrays)
    q, scale, mn = arrays
    codes = _unpack_rows(q).t()  # [K, N]
    half = codes.shape[1] // 2
    return ((codes[:, :half] | (codes[:, half:] << 4)).contiguous(), *_transposed((scale, mn)))


def dequantize_rows(dtype: str, arrays: tuple[torch.Tensor, ...], dtype_out: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """The ``[N, K]`` matrix in ``dtype_out`` (float32 is exact), a slice of rows at a time."""
    n = arrays[0].shape[0]
    k = arrays[0].shape[1] * (2 if dtype == "int4" else 1)
    out = torch.empty(n, k, dtype=dtype_out)
    for r0 in range(0, n, _SLICE):
        part = tuple(t[r0:r0 + _SLICE] for t in arrays)
        if dtype == "q8":
            w = part[0].float() * part[1].float().repeat_interleave(GROUP, dim=1)
        elif dtype == "int4":
            codes = _unpack_rows(part[0]).float().reshape(part[0].shape[0], k // GROUP, GROUP)
            w = (codes * part[1].float()[..., None] + part[2].float()[..., None]).reshape(-1, k)
        elif dtype == "fp8":
            w = part[0].view(torch.float8_e4m3fn).float() * part[1].repeat_interleave(FP8_BLOCK, dim=1)
        else:
            _check(dtype)
        out[r0:r0 + _SLICE] = w
    return out
