"""Plain-torch twins of the native CPU kernels (native/cpu/moed_cpu.h), for the tests.

Each twin computes the same formula as its kernel in float64, from the same bits: fp32/bf16
strips multiply the float activations by the widened weights; int4/q8/mxfp4 strips use the int8
activations (per group of 32 along K: ``xs = max|x| / 127``, ``xq = round(x / xs)``, ``xsum = xs *
sum(xq)``), whose group
sums are exact integers in both. The only difference left is the kernel's float32 summation
order, so a kernel must match its twin within ``1e-5`` of the sum of the absolute terms.
"""

from __future__ import annotations

import torch

from moed.kernels.int4_format import unpack_int4
from moed.kernels.mxfp4_format import e2m1_values

GROUP = 32


def quantize_activations(x: torch.Tensor, span: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, K]`` float32 -> ``(xq int8 [T, K], xs float32 [T, K/32], xsum [T, K/32])``, bit for bit
    what ``moed_quantize_act_span`` makes; ``xsum = xs * sum(xq)`` (the quantised values' sum). One
    scale per ``span`` values (32, or 256 for the K-quant rows: llama.cpp's Q8_K), repeated in each
    of its 32-groups' ``xs``."""
    t, k = x.shape
    if span % GROUP or k % span:
        raise ValueError(f"the span must be a multiple of {GROUP} dividing K, got {span} for K = {k}")
    g = x.reshape(t, k // span, span)
    xs = (g.abs().amax(dim=-1) / 127.0).repeat_interleave(span // GROUP, dim=-1)  # the same division as C
    g = x.reshape(t, k // GROUP, GROUP)
    safe = torch.where(xs > 0, xs, torch.ones_like(xs))
    xq = torch.where(xs[..., None] > 0, torch.round(g / safe[..., None]).clamp(-127, 127), torch.zeros_like(g))
    xq = xq.to(torch.int8)
    xsum = xs * xq.sum(dim=-1, dtype=torch.int32).float()  # float32 product, as the C code
    return xq.reshape(t, k), xs, xsum.double()


def matrix_product(dtype: str, arrays: tuple[torch.Tensor, ...], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` times one matrix ``[K, N]`` as the kernel computes it -> ``(y float64 [T, N], bound [T, N])``
    with ``bound`` the sum of the absolute terms (for the float32-order tolerance)."""
    x = x.float()
    if dtype in ("fp32", "bf16"):
        w = arrays[0].double()
        return x.double() @ w, x.double().abs() @ w.abs()
    xq, xs, xsum = quantize_activations(x)
    t, k = x.shape
    groups = k // GROUP
    if dtype == "int4":
        q, scale, mn = arrays
        codes = unpack_int4(q).double()  # [K, N]
        sc, mi = scale.double(), mn.double()  # [K/32, N]
    elif dtype == "q8":
        qs, d = arrays
        codes = qs.double()
        sc = d.double()
    elif dtype == "mxfp4":
        fp4, e8m0 = arrays
        codes = (e2m1_values(unpack_int4(fp4)) * 2).double()  # exact small integers
        sc = torch.ldexp(torch.ones(e8m0.shape, dtype=torch.float64), e8m0.to(torch.int32) - 128)
    else:
        raise ValueError(f"unknown dtype {dtype!r}")
    n = codes.shape[1]
    xg = xq.double().reshape(t, groups, GROUP)
    cg = codes.reshape(groups, GROUP, n)
    dots = torch.einsum("tgk,gkn->tgn", xg, cg)  # exact integers
    terms = dots * xs.double()[:, :, None] * sc[None]
    y = terms.sum(dim=1)
    bound = terms.abs().sum(dim=1)
    if dtype == "int4":
        mins = xsum[:, :, None] * mi[None]
        y = y + mins.sum(dim=1)
        bound = bound + mins.abs().sum(dim=1) + (x.double().abs().reshape(t, groups, GROUP).sum(-1)[:, :, None]
                                                 * mi.abs()[None]).sum(dim=1)
    return y, bound


def strip_reference(dtype: str, arrays: tuple[torch.Tensor, ...], x: torch.Tensor, j0: int, j1: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The strip ``[j0, j1)`` of the product (and of its upper half): ``(lo, hi, lo_bound, hi_bound)``."""
    y, bound = matrix_product(dtype, arrays, x)
    half = y.shape[1] // 2
    return y[:, j0:j1], y[:, half + j0:half + j1], bound[:, j0:j1], bound[:, half + j0:half + j1]


def _activate(gate_up: torch.Tensor, act) -> torch.Tensor:
    """``[T, 2I]`` (gate, then up) -> ``[T, I]``: SwiGLU, DeepSeek-V4's clamped SwiGLU, or gpt-oss's clamped variant
    (``act.kind``)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if act.kind == "silu":
        return torch.nn.functional.silu(gate) * up
    if act.kind == "relu2":
        return torch.relu(gate) * up
    if act.kind == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    if act.kind == "clamped_silu":
        return torch.nn.functional.silu(gate.clamp(max=act.limit)) * up.clamp(min=-act.limit, max=act.limit)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * act.alpha))


def routed_reference(bank, x: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of ``NativeCpu.moe`` with merging: ``(y float64 [N, D], tolerance [N, D])``.

    The tolerance is the float32-order bound of both matrices plus, for the quantised dtypes, one
    int8 step of every activation of the down matrix (the kernel quantises its own float32
    activations, whose last bits depend on the summation order, so a value at a rounding boundary
    may land one step away)."""
    from moed.kernels.expert_matmul import _packed_tensors, check_matrix

    fmt = check_matrix(bank.tensors, "gate_up")[0]

    def arrays(name: str, fid: int) -> tuple[torch.Tensor, ...]:
        ts = [bank.tensors[name]] if fmt in ("fp32", "bf16") else _packed_tensors(bank.tensors, fmt, name)
        return tuple(t[fid] for t in ts)

    n, a = flat_ids.shape
    y = torch.zeros(n, bank.hidden_size, dtype=torch.float64)
    tol = torch.zeros_like(y)
    for t in range(n):
        for s in range(a):
            fid = int(flat_ids[t, s])
            if fid < 0:
                continue
            h, hb = matrix_product(fmt, arrays("gate_up", fid), x[t:t + 1])
            if "gate_up_bias" in bank.tensors:
                h = h + bank.tensors["gate_up_bias"][fid].double()
            act = _activate(h.float(), bank.activation)  # [1, I] float32, as the kernel
            out, ob = matrix_product(fmt, arrays("down", fid), act)
            if "down_bias" in bank.tensors:
                out = out + bank.tensors["down_bias"][fid].double()
            # how far the activations may be off: the gate_up bound through the activation's slope (<= 1.1 |up|,
            # |gate| + 1 for gpt_oss), generously as 4 * (|h| + 1) * relative error, plus one int8 step
            inter = act.shape[1]
            rel = 1e-5 * (hb[:, :inter] + hb[:, inter:]) * 4 * (h.abs()[:, :inter] + h.abs()[:, inter:] + 1)
            step = torch.zeros_like(rel)
            if fmt not in ("fp32", "bf16"):
                step = (quantize_activations(act)[1].double().repeat_interleave(GROUP, dim=1))
            w_abs = dense_abs(fmt, arrays("down", fid))
            wgt = float(weights[t, s])
            y[t] += wgt * out[0]
            tol[t] += abs(wgt) * (1e-5 * ob[0] + ((rel + step) @ w_abs)[0])
    return y, tol


def dense_abs(dtype: str, arrays: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``|w|`` float64 ``[K, N]`` of one matrix, dequantised by the formats' torch references."""
    from moed.kernels.int4_format import dequantize_int4
    from moed.kernels.mxfp4_format import dequantize_mxfp4
    from moed.kernels.q8_format import dequantize_q8

    if dtype in ("fp32", "bf16"):
        return arrays[0].double().abs()
    dequantize = {"int4": dequantize_int4, "q8": dequantize_q8, "mxfp4": dequantize_mxfp4}[dtype]
    return dequantize(*arrays).double().abs()
