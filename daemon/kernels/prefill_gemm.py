"""Which dtype a many-token GEMM (prefill) multiplies bf16/fp16 weights in, on this CPU.

moed keeps weights in the checkpoint's dtype. For prefill it used to round the activations to bf16
and run torch's bf16 GEMM: 4-5x the float32 GEMM on CPUs whose oneDNN does bf16 (AVX-512 with
BW/VL/DQ, AVX-512 BF16, AMX), where transformers and llama.cpp also multiply bf16 weights in bf16.
Everywhere else (AVX2-only CPUs: every Intel desktop and laptop chip without AVX-512, AMD Zen 2
and 3) torch falls back to a scalar reference GEMM: on an AVX2 Zen 3, 2 threads, one expert's
gate_up ``[128, 2048] @ [2048, 1536]`` took 1041 ms in bf16 and 30 ms widened to float32 (the
widening included), and a 128-token prompt of the 6-layer bench model took 84 s. So the half
dtype is used only where oneDNN says it runs it natively; otherwise weights are widened to
float32 for the GEMM (exact) and the activations are not rounded. The answer is torch's own
(``torch.ops.mkldnn._is_mkldnn_bf16_supported``: the same check that routes its CPU matmul to
oneDNN), asked once per process. Tensors not on the CPU (CUDA) always multiply in their dtype.

On those same CPUs, int4 expert banks skip the GEMM altogether: many tokens go through the
native MoE call, whose strips multiply the weights' 4-bit codes with int8 activations
(``maddubs``, as llama.cpp's prefill does) and never dequantise. Zen 3, 2 threads, the 6-layer
bench model from its Q4_1 GGUF, a 1024-token prompt in 256-token chunks: the experts took 4.1-4.3 s
against 7.9-8.3 s for dequantising each expert into a float32 GEMM (prefill 100-107 tok/s against
70-73). For q8 the two are even at 256-token chunks and the GEMM wins at 1024 (6.4-6.7 s against
7.5-8.4 s), so q8 (and mxfp4, not measured end to end) keep the GEMM; so does every bank where
oneDNN multiplies bf16 natively (not measured against the strips there yet).
``MOED_PREFILL_INT8=1`` / ``0`` forces either way for the quantised banks (``native_prefill``).
"""

from __future__ import annotations

import functools
import os

import torch

QUANTISED_BANKS = ("int4", "q8", "mxfp4")  # banks the native strips multiply with int8 activations
NATIVE_PREFILL_BANKS = ("int4",)  # where that beats the GEMM at prefill (measured, see above)


@functools.cache
def _cpu_runs_natively(dtype: torch.dtype) -> bool:
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    if probe is None:
        return dtype == torch.float32
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN: its half GEMM is the slow one
        return False


def prefill_gemm_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to multiply weights of ``weight_dtype`` in, for many tokens, on ``device``:
    ``weight_dtype`` where that GEMM is native there, else float32."""
    if device.type != "cpu" or weight_dtype == torch.float32:
        return weight_dtype
    return weight_dtype if _cpu_runs_natively(weight_dtype) else torch.float32


def native_prefill(bank_dtype: str) -> bool:
    """Whether many tokens of a ``bank_dtype`` expert bank run through the native int8 strips on
    this CPU (see the module doc) instead of per-expert torch GEMMs."""
    raw = os.environ.get("MOED_PREFILL_INT8", "")
    forced = raw.strip().lower()
    if forced not in ("", "0", "off", "no", "false", "1", "on", "yes", "true"):
        raise ValueError(f"MOED_PREFILL_INT8={raw!r}: use 1 (int8 strips) or 0 (dequantise + GEMM), "
                         "or unset it for this CPU's default")
    if forced in ("0", "off", "no", "false") or bank_dtype not in QUANTISED_BANKS:
        return False
    if forced in ("1", "on", "yes", "true"):
        return True
    return bank_dtype in NATIVE_PREFILL_BANKS and not _cpu_runs_natively(torch.bfloat16)
