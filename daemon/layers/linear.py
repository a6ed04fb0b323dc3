"""``linear``: y = x W^T + b for float32 activations and weights kept in the checkpoint's dtype.

With float32 weights it is plain F.linear. With bf16 weights in host memory and a few rows (decode,
small batches) it is the native bf16 GEMV (moed.kernels.native_cpu: float32 activations, bf16
weights widened exactly, fp32 accumulation, near the memory bandwidth; ``linear_many`` runs several
weights that share x, an attention layer's q/k/v, in one native call). Otherwise, with bf16/fp16
weights, the activations are rounded to the weights' dtype and multiplied there (oneDNN/cuBLAS
accumulate in float32) and the result comes back as float32: what llama.cpp does for bf16 weights,
at half the bytes per weight of float32; on a CPU without a native half GEMM (AVX2-only) the weight
is widened to float32 for the GEMM instead (kernels/prefill_gemm.py). The bias, if any, is added in float32.
A PackedLinear weight (q8/int4, kept packed from a quantised GGUF) multiplies itself
(layers/packed_linear.py: the native kernel for a few rows, float32 otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moed.kernels.native_cpu import MAX_TOKENS, native
from moed.kernels.prefill_gemm import prefill_gemm_dtype
from moed.layers.packed_linear import PackedLinear


def _native_rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Rows of ``x`` for the native GEMV, or 0 when it does not apply."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or x.device.type != "cpu" \
            or weight.dim() != 2 or not weight.is_contiguous():
        return 0
    rows = x.numel() // max(x.shape[-1], 1)
    return rows if 0 < rows <= MAX_TOKENS and native() is not None else 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32, weight [N, K] -> [..., N] float32."""
    if isinstance(weight, PackedLinear):
        return _packed(x, weight, bias)
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    rows = _native_rows(x, weight)
    if rows:
        out = native().dense_bf16(x.reshape(rows, x.shape[-1]).float(), weight).view(*x.shape[:-1], weight.shape[0])
    elif prefill_gemm_dtype(weight.dtype, weight.device) == torch.float32:
        out = F.linear(x.float(), weight.float())  # no native half GEMM on this CPU (kernels/prefill_gemm.py)
    else:
        out = F.linear(x.to(weight.dtype), weight).float()
    return out if bias is None else out + bias.float()


def embedding(ids: torch.Tensor, table: "torch.Tensor | PackedLinear") -> torch.Tensor:
    """The rows ``ids`` of an embedding table ``[V, D]`` as float32 ``[*ids.shape, D]``: a tensor of any
    float dtype, or a PackedLinear (a GGUF token_embd kept in its own type: only the looked-up rows decode)."""
    if isinstance(table, PackedLinear):
        return table.take_rows(ids)
    return F.embedding(ids, table).float()


def linear_many(x: torch.Tensor, weights: tuple, biases: tuple) -> list[torch.Tensor]:
    """``[linear(x, w, b) for w, b in zip(weights, biases)]``; bf16 weights at decode, or PackedLinear
    weights of one dtype, go to the native kernel in one call (an attention layer's q, k and v: x
    prepared or quantised once, one dispatch), the same bits as one by one."""
    flat = x.reshape(-1, x.shape[-1])
    if all(isinstance(w, PackedLinear) for w in weights):
        outs = PackedLinear.matmul_many(tuple(weights), flat)
    elif _native_rows(x, weights[0]) and all(_native_rows(x, w) for w in weights[1:]):
        outs = native().dense_bf16_many(flat.float(), weights)
    else:
        return [linear(x, w, b) for w, b in zip(weights, biases)]
    lead = x.shape[:-1]
    return [out.view(*lead, -1) if b is None else out.view(*lead, -1) + b.float() for out, b in zip(outs, biases)]


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As ``linear`` but always float32 arithmetic (the router: routing must not see bf16-rounded inputs)."""
    if isinstance(weight, PackedLinear):  # routers are F32 in GGUF files; a quantised one runs as stored
        return _packed(x.float(), weight, bias)
    if _native_rows(x, weight):
        return linear(x.float(), weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def _packed(x: torch.Tensor, weight: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
    k, n = weight.in_features, weight.out_features
    out = weight.matmul(x.reshape(-1, k)).view(*x.shape[:-1], n)
    return out if bias is None else out + bias.float()
