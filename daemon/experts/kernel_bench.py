"""Decode-time expert kernel benchmark: weight GB/s of ``run_expert`` against the machine's read bandwidth."""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any, Callable, Sequence

import numba
import numpy as np
import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import EXPERT_DTYPES, GGML_BANK, ExpertActivation, ExpertBank
from moed.experts.cpu_layout import interleave_for_cpu
from moed.experts.routed_ffn import PREFILL_TOKENS, run_routed, uses_native
from moed.kernels.native_cpu import descriptor_of, native, native_status
from moed.experts.expert_ffn import ggml_gemm_prefill
from moed.kernels.bandwidth import read_sum_kernel
from moed.kernels.expert_matmul import launch_guard, threading_layer

DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((576, 1536), (2048, 768))  # (D, I)
_TEMPLATE_EXPERTS = 4  # distinct random experts; the bank repeats them to its full size


def _random_bank(hidden: int, inter: int, dtype: str, bank_bytes: int, seed: int) -> ExpertBank:
    """A bank of at least ``bank_bytes`` (so caches cannot hold it) built from a few random experts."""
    gen = torch.Generator().manual_seed(seed)
    n = _TEMPLATE_EXPERTS
    gate_up = torch.randn(n, hidden, 2 * inter, generator=gen) / math.sqrt(hidden)  # [n, D, 2I]
    down = torch.randn(n, inter, hidden, generator=gen) / math.sqrt(inter)  # [n, I, D]
    small = build_expert_bank(
        gate_up, down, num_moe_layers=1, num_experts=n, dtype=dtype, activation=ExpertActivation("silu")
    )
    copies = max(1, math.ceil(bank_bytes / small.nbytes()))
    tensors = {k: v.repeat(copies, *([1] * (v.dim() - 1))) for k, v in small.tensors.items()}
    return ExpertBank(
        num_moe_layers=1,
        num_experts=n * copies,
        hidden_size=hidden,
        intermediate_size=inter,
        dtype=dtype,
        activation=small.activation,
        tensors=tensors,
    )


GGML_PREFIX = "ggml:"  # ggml:Q4_K ... one GGUF block type kept as stored (the ggml bank)
# the fp16 fields of each kept type's block (byte offsets): set to small values so the random blocks
# hold finite, moderate weights; MXFP4's e8m0 exponent (byte 0) gets 2^0, NVFP4's E4M3 scales 1.0
_FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def ggml_bench_dtypes() -> tuple[str, ...]:
    from moed.kernels.ggml_rows_format import ROW_TYPES
    from moed.kernels.gguf_quants import type_name

    return tuple(GGML_PREFIX + type_name(t) for t in ROW_TYPES)


def ggml_shape_ok(dtype: str, hidden: int, inter: int) -> bool:
    """Whether D and I hold whole blocks of the type (K-quants: 256 weights)."""
    from moed.kernels.gguf_quants import block_size, type_id

    weights = block_size(type_id(dtype[len(GGML_PREFIX):]))[0]
    return hidden % weights == 0 and inter % weights == 0


def _random_ggml_bank(hidden: int, inter: int, dtype: str, bank_bytes: int, seed: int) -> ExpertBank:
    """A one-layer ggml bank of random valid blocks of one type, at least ``bank_bytes``."""
    from moed.kernels.ggml_rows_format import row_bytes
    from moed.kernels.gguf_quants import type_id

    name = dtype[len(GGML_PREFIX):]
    ggml_type = type_id(name)
    per_expert = 2 * inter * row_bytes(ggml_type, hidden) + hidden * row_bytes(ggml_type, inter)
    experts = max(8, math.ceil(bank_bytes / per_expert))
    gen = torch.Generator().manual_seed(seed)
    tensors, types = {}, {}
    for kind, rows, k in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
        tensors[f"{kind}.0"], types[f"{kind}.0"] = random_rows(name, (experts, rows), k, gen), ggml_type
    return ExpertBank(num_moe_layers=1, num_experts=experts, hidden_size=hidden, intermediate_size=inter,
                      dtype=GGML_BANK, activation=ExpertActivation("silu"), tensors=tensors, row_types=types)


def random_rows(name: str, lead: tuple[int, ...], k: int, gen: torch.Generator, scale: float = 0.01) -> torch.Tensor:
    """Random valid rows of GGML type ``name`` (``uint8 [*lead, row_bytes]``): finite, moderate scales (the
    fp16 block scales ``scale``)."""
    from moed.kernels.ggml_rows_format import row_bytes
    from moed.kernels.gguf_quants import block_size, type_id

    ggml_type = type_id(name)
    raw = torch.randint(0, 256, (*lead, row_bytes(ggml_type, k)), dtype=torch.uint8, generator=gen)
    blocks = raw.view(-1, block_size(ggml_type)[1])
    if name == "MXFP4":
        blocks[:, 0] = 127
    if name == "NVFP4":  # its four E4M3 scales: 0x38 is 1.0
        blocks[:, 0:4] = 0x38
    if name == "MXFP8":  # 2^0, and finite e4m3 codes (0x7F / 0xFF are NaN)
        blocks[:, 0] = 127
        blocks[:, 1:] &= 0x77
    if name == "FP8_B128":  # a float32 scale of 0.01, finite codes
        blocks[:, 0:4] = torch.tensor([0.01], dtype=torch.float32).view(torch.uint8)
        blocks[:, 4:] &= 0x77
    for off in _FP16_FIELDS.get(name, ()):
        blocks[:, off:off + 2] = torch.tensor([scale], dtype=torch.float16).view(torch.uint8)
    return raw


def _read_pass(buf: np.ndarray) -> float:
    """Seconds for one parallel read of ``buf``: on the native kernels' own threads where they are built
    (read_bw.c; numba's OpenMP threads spin on after each read and took the two cores from the kernel pass
    that followed), else numba's."""
    lib = native()
    if lib is not None:
        return lib.read_pass(torch.from_numpy(buf))[0]
    with launch_guard():
        nparts = numba.get_num_threads()
        t0 = time.perf_counter()
        read_sum_kernel(buf, nparts)
        return time.perf_counter() - t0


def _alternate(one_pass: Callable[[], float], buf: np.ndarray, buf_4k: np.ndarray, trials: int,
               nbytes: float) -> dict[str, float]:
    """``trials`` rounds of read pass, 4 KiB-page read pass, kernel pass (``one_pass`` reads
    ``nbytes``), then one more read: the best of each, and ``paired_ratio``, the median over the
    rounds of the kernel's GB/s over the mean of the two reads around it. On a machine whose
    bandwidth moves from minute to minute (a VM on a shared host) the best kernel pass and the best
    read can come from different moments; a pass and its neighbouring reads see the same one."""
    reads, reads_4k, passes = [_read_pass(buf)], [], []
    for _ in range(trials):
        reads_4k.append(_read_pass(buf_4k))
        passes.append(one_pass())
        reads.append(_read_pass(buf))
    paired = sorted((nbytes / p) / (buf.nbytes / ((a + b) / 2)) for p, a, b in zip(passes, reads, reads[1:]))
    mid = len(paired) // 2
    return dict(
        best_pass=min(passes),
        read_gbps=buf.nbytes / min(reads) / 1e9,
        read_4k_gbps=buf_4k.nbytes / min(reads_4k) / 1e9,
        paired_ratio=paired[mid] if len(paired) % 2 else (paired[mid - 1] + paired[mid]) / 2,
    )


def _expert_pass(bank: ExpertBank, x: torch.Tensor, per_call: int) -> float:
    """Seconds to run every expert of ``bank`` once, ``per_call`` distinct experts per MoE call (a
    decode step's layer: each token routed to all of them). Where the native MoE call runs the tokens, the
    calls follow each other as the decode chain makes them, with no Python between (``moe_ggml_calls``);
    otherwise as the executors call them (``run_routed``)."""
    ones = torch.full((x.shape[0], per_call), 1.0 / per_call)
    ids = [torch.arange(start, start + per_call, dtype=torch.int32).expand(x.shape[0], per_call).contiguous()
           for start in range(0, bank.num_slots - per_call + 1, per_call)]
    lib = native()
    if uses_native(bank, x.shape[0]) and x.shape[0] <= PREFILL_TOKENS and not ggml_gemm_prefill(x.shape[0]):
        if bank.dtype == GGML_BANK:  # a one-layer bench bank: its flat ids are the layer's expert numbers
            return lib.moe_ggml_calls(bank, 0, x, ids, ones)
        return lib.moe_calls(descriptor_of(bank), x, ids, ones)
    t0 = time.perf_counter()
    for i in ids:
        run_routed(bank, x, i, ones)
    return time.perf_counter() - t0


def bench_kernels(
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    dtypes: Sequence[str] = EXPERT_DTYPES,
    *,
    tokens: int = 1,
    per_call: int = 8,
    bank_bytes: int = 512 * 2**20,
    read_bytes: int = 128 * 2**20,
    trials: int = 12,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """For each dtype and expert shape ``(D, I)``: GB/s of expert weights read by the CPU expert path
    (``run_routed``, ``per_call`` experts per call like a top-8 decode layer; the native kernels, or
    numba where they are not built: ``native_status()``).

    Expert passes and read-bandwidth passes alternate and each keeps its best of ``trials``,
    so both see the same machine state (other processes, other VMs on the host). Two reads:
    ``read_gbps`` over a numpy buffer (numpy asks for transparent huge pages: the STREAM-like
    figure, and ``ratio`` is against it) and ``read_4k_gbps`` over a torch buffer (4 KiB pages).
    ``paired_ratio`` is the median over the rounds of each expert pass against the reads just
    before and after it (``_alternate``): the steadier figure where the bandwidth moves. One row
    per case: ``dtype, layout`` (a ggml bank's: "x8" where the CPU executor interleaves its rows,
    experts/cpu_layout.py), ``hidden, intermediate, tokens, experts, bytes_per_expert, us_per_expert,
    weight_gbps, read_gbps, read_4k_gbps, ratio, paired_ratio``.
    """
    if tokens < 1 or trials < 1:
        raise ValueError(f"tokens and trials must be >= 1, got {tokens}, {trials}")
    buf = np.ones(read_bytes // 4, dtype=np.float32)  # written, so no page faults in timing
    buf_4k = torch.ones(read_bytes // 4).numpy()
    _read_pass(buf)  # compile
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for hidden, inter in shapes:
            if dtype.startswith(GGML_PREFIX):
                if not ggml_shape_ok(dtype, hidden, inter):
                    continue  # not whole blocks of this type at this shape
                bank = _random_ggml_bank(hidden, inter, dtype, bank_bytes, seed)
                x8 = interleave_for_cpu(bank)  # as the CPU executor lays it out
            else:
                bank = _random_bank(hidden, inter, dtype, bank_bytes, seed)
                x8 = {}
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
            run_routed(bank, x, torch.zeros(tokens, 1, dtype=torch.int32))  # compile / warm up
            per_expert = bank.bytes_per_expert()
            run = bank.num_slots // per_call * per_call
            m = _alternate(functools.partial(_expert_pass, bank, x, per_call), buf, buf_4k, trials, per_expert * run)
            weight_gbps = per_expert * run / m["best_pass"] / 1e9
            rows.append(
                dict(
                    dtype=dtype,
                    layout="x8" if x8 else "rows",
                    hidden=hidden,
                    intermediate=inter,
                    tokens=tokens,
                    experts=bank.num_slots,
                    bytes_per_expert=per_expert,
                    us_per_expert=m["best_pass"] / run * 1e6,
                    weight_gbps=weight_gbps,
                    read_gbps=m["read_gbps"],
                    read_4k_gbps=m["read_4k_gbps"],
                    ratio=weight_gbps / m["read_gbps"],
                    paired_ratio=m["paired_ratio"],
                )
            )
            del bank
    return rows


# dense projections: bf16, q8 / int4 rows, FP8 as stored, and a GGUF's own types (Q4_K_M's Q4_K and Q6_K)
DENSE_DTYPES = ("bf16", "q8", "int4", "fp8", "q4_k", "q6_k")


def _dense_matrices(n: int, k: int, dtype: str, total_bytes: int, seed: int) -> tuple[list, int]:
    """Enough distinct ``[N, K]`` weights in ``dtype`` (layers/linear.py's bf16, PackedLinear's rows
    layouts) to fill ``total_bytes``, so each pass reads them from DRAM; and the bytes of one."""
    from moed.kernels.int4_format import quantize_int4
    from moed.kernels.q8_format import quantize_q8
    from moed.kernels.rows_format import rows_from_kn

    from moed.kernels.ggml_rows_format import LINEAR_TYPES as GGML_LINEAR
    from moed.kernels.gguf_quants import type_name

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if dtype in GGML_LINEAR:  # random valid rows of the GGUF type, as a file keeps them
        one = (random_rows(type_name(GGML_LINEAR[dtype]), (n,), k, torch.Generator().manual_seed(seed)),)
    elif dtype == "bf16":
        one: tuple[torch.Tensor, ...] = (w.bfloat16(),)
    elif dtype == "fp8":  # e4m3 codes and a float32 scale per 128 weights of a row (an FP8 checkpoint's)
        one = ((w * 400).to(torch.float8_e4m3fn).view(torch.uint8).contiguous(), torch.full((n, k // 128), 1 / 400.0))
    else:
        one = rows_from_kn(dtype, (quantize_q8 if dtype == "q8" else quantize_int4)(w.t().contiguous()))
    nbytes = sum(t.numel() * t.element_size() for t in one)
    count = max(2, total_bytes // nbytes)
    return [tuple(t.clone() for t in one) for _ in range(count)], nbytes


def bench_dense(shapes: Sequence[tuple[int, int]], dtypes: Sequence[str] = DENSE_DTYPES, *, tokens: int = 1,
                total_bytes: int = 512 * 2**20, read_bytes: int = 128 * 2**20, trials: int = 8,
                seed: int = 0) -> list[dict[str, Any]]:
    """GB/s of the native dense GEMVs (attention projections, lm_head: ``dense_bf16_many`` for bf16,
    ``rows_many`` for q8/int4) on ``[N, K]`` weights, one matrix per call as at decode, alternating
    with read-bandwidth passes like ``bench_kernels``. Rows as ``bench_kernels``'s with ``hidden`` =
    K, ``intermediate`` = N, ``experts`` = matrices, ``dtype`` prefixed ``dense ``. Needs the native
    library (ValueError otherwise)."""

    lib = native()
    if lib is None:
        raise ValueError(f"the dense GEMV benchmark needs the native CPU kernels ({native_status()})")
    buf = np.ones(read_bytes // 4, dtype=np.float32)
    buf_4k = torch.ones(read_bytes // 4).numpy()
    _read_pass(buf)
    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for n, k in shapes:
            from moed.kernels.ggml_rows_format import LINEAR_TYPES as GGML_LINEAR
            from moed.kernels.gguf_quants import block_size

            if (dtype == "fp8" and k % 128) or (dtype in GGML_LINEAR and k % block_size(GGML_LINEAR[dtype])[0]):
                continue  # FP8 rows hold whole 128-weight blocks, a GGUF type's rows whole blocks of it
            mats, nbytes = _dense_matrices(n, k, dtype, total_bytes, seed)
            x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed))

            def one_pass() -> float:
                t0 = time.perf_counter()
                for arrays in mats:
                    if dtype == "bf16":
                        lib.dense_bf16_many(x, arrays)
                    elif dtype in GGML_LINEAR:
                        lib.ggml_rows([(arrays[0], GGML_LINEAR[dtype])], x)
                    else:
                        lib.rows_many(dtype, [arrays], x)
                return time.perf_counter() - t0

            one_pass()
            m = _alternate(one_pass, buf, buf_4k, trials, nbytes * len(mats))
            weight_gbps = nbytes * len(mats) / m["best_pass"] / 1e9
            rows.append(dict(dtype=f"dense {dtype}", hidden=k, intermediate=n, tokens=tokens, experts=len(mats),
                             bytes_per_expert=nbytes, us_per_expert=m["best_pass"] / len(mats) * 1e6,
                             weight_gbps=weight_gbps, read_gbps=m["read_gbps"], read_4k_gbps=m["read_4k_gbps"],
                             ratio=weight_gbps / m["read_gbps"], paired_ratio=m["paired_ratio"]))
            mats = []  # free them before the next shape's
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of ``bench_kernels`` as a markdown table."""
    lines = [
        "| dtype | D | I | T | experts | MB/expert | us/expert | weight GB/s | read GB/s | read 4K GB/s | ratio "
        "| paired |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']}{' (x8)' if r.get('layout') == 'x8' else ''} | {r['hidden']} | {r['intermediate']} | {r['tokens']} | {r['experts']} "
            f"| {r['bytes_per_expert'] / 1e6:.2f} | {r['us_per_expert']:.1f} | {r['weight_gbps']:.1f} "
            f"| {r['read_gbps']:.1f} | {r['read_4k_gbps']:.1f} | {r['ratio']:.0%} | {r['paired_ratio']:.0%} |"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines.append(f"\nbackend: {native_status()}; {numba.get_num_threads()} numba threads ({threading_layer()}), "
                 f"load average {load:.2f}")
    return "\n".join(lines)
