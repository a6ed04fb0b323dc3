"""Grouped expert matmuls over device cache slots: the cupy int4 kernel, torch for fp32/bf16/q8/mxfp4, torch twins.

Shapes: ``T`` tokens (grouped by expert), ``E`` experts in the call, ``S`` slots, ``K`` input and
``N`` output columns of one matrix. Expert ``e`` multiplies the token rows
``x[offsets[e]:offsets[e+1]]`` by the matrix in slot ``slot_ids[e]``. cupy is imported only
when the CUDA kernel is launched, so CPU-only machines never need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

INT4_GROUP_SIZE = 32  # must match the bank layout (moed.kernels.int4_format; a test checks)
BLOCK_GROUP_SIZE = 32  # q8 and mxfp4 groups along K (moed.kernels.q8_format / mxfp4_format; a test checks)
# Block-scaled formats: main tensor suffix, its dtype, whether two columns share a byte, scale suffix and dtype.
_BLOCK_SCALED = {
    "q8": (".qs", torch.int8, False, ".d", torch.float16),
    "mxfp4": (".fp4", torch.uint8, True, ".e8m0", torch.uint8),
}
KERNEL_FILE = "expert_int4.cu"
KERNEL_NAME = "expert_int4_grouped_matmul"
_BLOCK = 128  # threads per block; must match BLOCK in the .cu source
# From this many rows per expert on average (prefill), a grouped int4 matmul dequantises its slots
# and runs GEMMs instead of the kernel (which re-reads the weights for every 8 rows, on CUDA cores).
GEMM_MIN_ROWS_PER_EXPERT = 32
DEQUANT_CHUNK_BYTES = 256 << 20  # float32 scratch for the dequantised slots of one chunk of experts

# GGUF block rows in slots (the ggml bank): one kernel per GGML type, decoding weight by weight (native/ggml_rows.cu)
GGML_KERNEL_FILE = "ggml_rows.cu"
GGML_KERNEL_TYPES = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 39, 40, 1001, 1002)  # the ggml bank's row types
GGML_WARPS = 4  # output rows per CUDA block (one warp each); must match WARPS in the .cu source

_kernels: dict[int, Any] = {}  # device index -> compiled cupy.RawKernel
_ggml_modules: dict[int, Any] = {}  # device index -> compiled cupy.RawModule of ggml_rows.cu
_streams: dict[int, Any] = {}  # cudaStream_t address -> cupy stream wrapping that torch stream

Index = Sequence[int] | torch.Tensor


def kernel_source_path(native_dir: Path | None = None, name: str = KERNEL_FILE) -> Path:
    """Where a CUDA source (default ``expert_int4.cu``) is: ``native_dir`` if given, else the repository's
    ``native/``, else beside this module."""
    here = Path(__file__).resolve().parent
    candidates = [Path(native_dir)] if native_dir is not None else [here.parents[1] / "native", here / "native"]
    for folder in candidates:
        path = folder / name
        if path.is_file():
            return path
    looked = ", ".join(str(c / name) for c in candidates)
    raise FileNotFoundError(
        f"CUDA kernel source {name} not found (looked at {looked}); it ships in the repository's "
        f"native/ folder: run from a source checkout, or copy native/{name} next to {__file__}"
    )


def native_source_dir() -> Path:
    """The folder of the CUDA sources and the headers they include (``native/``)."""
    return kernel_source_path(name=GGML_KERNEL_FILE).parent


# --------------------------------------------------------------------------- checks


def as_index(v: Index, what: str, device: torch.device) -> torch.Tensor:
    """``v`` as a 1-D int32 tensor on ``device`` (a list is copied over; a tensor must already be there)."""
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype != torch.int32:
            raise ValueError(f"{what} must be a 1-D int32 tensor, got {v.dtype} {tuple(v.shape)}")
        if v.device != device:
            raise ValueError(f"{what} is on {v.device} but x is on {device}")
        return v.contiguous()
    host = torch.tensor([int(i) for i in v], dtype=torch.int32)
    if device.type == "cpu":
        return host
    # from pinned memory with non_blocking: a pageable upload would make the host wait for the stream
    return host.pin_memory().to(device, non_blocking=True)


def check_int4_grouped(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, slot_ids: Index, offsets: Index
) -> tuple[int, int, int]:
    """Validate shapes, dtypes, devices and contiguity; returns ``(S, K, N)``. Index values are checked when given as lists."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be float32 [T, K], got {x.dtype} {tuple(x.shape)}")
    if q.dim() != 3 or q.dtype != torch.uint8:
        raise ValueError(f"q must be uint8 [S, K, N/2], got {q.dtype} {tuple(q.shape)}")
    num_slots, k, half = q.shape
    n = 2 * half
    if k % INT4_GROUP_SIZE:
        raise ValueError(f"K={k} is not a multiple of the int4 group size {INT4_GROUP_SIZE}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns but the weights have K={k} rows")
    want = (num_slots, k // INT4_GROUP_SIZE, n)
    for name, t in (("scale", scale), ("min", mn)):
        if t.dtype != torch.bfloat16 or tuple(t.shape) != want:
            raise ValueError(f"{name} must be bfloat16 {want} for q {tuple(q.shape)}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("x", x), ("q", q), ("scale", scale), ("min", mn)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    _check_groups(x.shape[0], num_slots, slot_ids, offsets)
    return num_slots, k, n


def _check_groups(num_tokens: int, num_slots: int, slot_ids: Index, offsets: Index) -> None:
    n_ids = len(slot_ids)
    if len(offsets) != n_ids + 1:
        raise ValueError(f"offsets must have len(slot_ids) + 1 = {n_ids + 1} entries, got {len(offsets)}")
    if isinstance(slot_ids, torch.Tensor) or isinstance(offsets, torch.Tensor):
        return  # device-side indices are trusted (checking them would cost a host round trip)
    ids, offs = [int(i) for i in slot_ids], [int(o) for o in offsets]
    for s in ids:
        if not 0 <= s < num_slots:
            raise ValueError(f"slot id {s} out of range (there are {num_slots} slots)")
    if offs[0] != 0 or offs[-1] != num_tokens or any(a > b for a, b in zip(offs, offs[1:])):
        raise ValueError(f"offsets must rise from 0 to the token count {num_tokens}, got {offs}")


# --------------------------------------------------------------------------- int4


def dequantize_slot(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """One slot's ``q [K, N/2]``, ``scale/min [K/32, N]`` -> float32 ``W [K, N]`` (``w = q*scale + min``)."""
    levels = torch.cat([q & 0x0F, q >> 4], dim=-1).float()  # [K, N]
    k, n = levels.shape
    g = levels.view(k // INT4_GROUP_SIZE, INT4_GROUP_SIZE, n)  # scales broadcast over each group's rows
    return (g * scale.float()[:, None] + mn.float()[:, None]).view(k, n)


def int4_grouped_matmul_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, slot_ids: Index, offsets: Index
) -> torch.Tensor:
    """Torch twin of ``int4_grouped_matmul`` (any device): dequantize each slot, then ``x @ W``."""
    _, _, n = check_int4_grouped(x, q, scale, mn, slot_ids, offsets)
    ids = slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else list(slot_ids)
    offs = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    y = torch.zeros((x.shape[0], n), dtype=torch.float32, device=x.device)  # [T, N]
    for e, s in enumerate(ids):
        a, b = offs[e], offs[e + 1]
        if b > a:
            y[a:b] = x[a:b] @ dequantize_slot(q[s], scale[s], mn[s])
    return y


def _cupy(what: str) -> Any:
    """cupy, imported only when a CUDA kernel is launched; ``what`` names the kernels in the error."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(f"{what} need(s) cupy: pip install cupy-cuda12x (or cupy-cuda13x to match your CUDA "
                           "driver)") from exc
    return cupy


def _index_of(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _kernel(device: torch.device) -> Any:
    index = _index_of(device)
    kern = _kernels.get(index)
    if kern is None:
        cupy = _cupy("the CUDA int4 expert kernel")
        source = kernel_source_path().read_text()
        with cupy.cuda.Device(index):
            kern = cupy.RawKernel(source, KERNEL_NAME)
            kern.compile()  # compile now, so a broken toolchain fails here with its own message
        _kernels[index] = kern
    return kern


def _cupy_stream(cupy: Any, stream: torch.cuda.Stream) -> Any:
    """cupy's view of a torch stream, so the kernel is ordered with the surrounding torch work."""
    key = stream.cuda_stream
    wrapped = _streams.get(key)
    if wrapped is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # cupy >= 14: the CUDA stream protocol
            wrapped = cupy.cuda.Stream.from_external(stream)
        else:
            wrapped = cupy.cuda.ExternalStream(key, stream.device.index)
        _streams[key] = wrapped
    return wrapped


def int4_grouped_matmul(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, slot_ids: Index, offsets: Index
) -> torch.Tensor:
    """``y [T, N]`` float32: for each expert ``e``, ``x[offsets[e]:offsets[e+1]] @ W[slot_ids[e]]``, on CUDA.

    ``x`` float32 ``[T, K]``; ``q`` uint8 ``[S, K, N/2]``; ``scale``/``min`` bf16 ``[S, K/32, N]``,
    all contiguous on one CUDA device. ``slot_ids`` / ``offsets`` are lists (checked) or int32
    CUDA tensors (trusted). Runs on the current torch stream.
    """
    _, k, n = check_int4_grouped(x, q, scale, mn, slot_ids, offsets)
    if x.device.type != "cuda":
        raise ValueError(f"int4_grouped_matmul runs on CUDA tensors; x is on {x.device} (use the _reference twin)")
    if not isinstance(slot_ids, torch.Tensor) and not isinstance(offsets, torch.Tensor) and (
            x.shape[0] >= GEMM_MIN_ROWS_PER_EXPERT * max(len(slot_ids), 1)):
        return int4_grouped_gemm(x, q, scale, mn, slot_ids, offsets)
    ids = as_index(slot_ids, "slot_ids", x.device)
    offs = as_index(offsets, "offsets", x.device)
    y = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)  # [T, N]
    num_experts = ids.shape[0]
    if num_experts == 0 or x.shape[0] == 0:
        return y.zero_()
    kern = _kernel(x.device)

    import cupy
    import numpy as np

    def cp(t: torch.Tensor) -> Any:
        return cupy.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)

    with cupy.cuda.Device(x.device.index), _cupy_stream(cupy, torch.cuda.current_stream(x.device)):
        grid = ((n // 2 + _BLOCK - 1) // _BLOCK, num_experts)
        kern(grid, (_BLOCK,), (cp(x), cp(q), cp(scale), cp(mn), cp(ids), cp(offs), cp(y), np.int32(k), np.int32(n)))
    return y


def dequantize_slots(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Several slots at once: ``q [E, K, N/2]``, ``scale/min [E, K/32, N]`` -> float32 ``W [E, K, N]``
    (the same arithmetic as ``dequantize_slot``, slot by slot)."""
    levels = torch.cat([q & 0x0F, q >> 4], dim=-1).float()  # [E, K, N]
    e, k, n = levels.shape
    g = levels.view(e, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE, n)
    return (g * scale.float()[:, :, None] + mn.float()[:, :, None]).view(e, k, n)


def int4_grouped_gemm(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, slot_ids: Sequence[int],
    offsets: Sequence[int]
) -> torch.Tensor:
    """The many-rows form of ``int4_grouped_matmul`` (prefill: tens to hundreds of rows per expert).

    The int4 kernel streams each slot's weights once per tile of 8 rows and runs on CUDA cores;
    with many rows per expert the work is a real GEMM. The call's slots are dequantised to float32
    ``DEQUANT_CHUNK_BYTES`` at a time and each expert's rows multiplied by a plain fp32 GEMM
    (cuBLAS; TF32 stays off unless the user turned it on): the reference twin's arithmetic.
    """
    _, k, n = check_int4_grouped(x, q, scale, mn, slot_ids, offsets)
    ids, offs = [int(i) for i in slot_ids], [int(o) for o in offsets]
    y = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)  # [T, N]
    per_chunk = max(1, DEQUANT_CHUNK_BYTES // (k * n * 4))
    for c0 in range(0, len(ids), per_chunk):
        chunk = ids[c0 : c0 + per_chunk]
        index = as_index(chunk, "slot_ids", x.device).long()
        w = dequantize_slots(q.index_select(0, index), scale.index_select(0, index), mn.index_select(0, index))
        for j in range(len(chunk)):
            a, b = offs[c0 + j], offs[c0 + j + 1]
            if b > a:
                torch.matmul(x[a:b], w[j], out=y[a:b])
    return y


def _one_slot(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if q.dim() != 2 or scale.dim() != 2 or mn.dim() != 2:
        raise ValueError(
            f"one matrix: q [K, N/2], scale/min [K/32, N] expected, got {tuple(q.shape)}, "
            f"{tuple(scale.shape)}, {tuple(mn.shape)}"
        )
    return q.unsqueeze(0), scale.unsqueeze(0), mn.unsqueeze(0)  # [1, ...] views (contiguity kept)


def int4_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """One matrix: ``x [T, K]`` float32 @ int4 ``W [K, N]`` (``q [K, N/2]``, ``scale/min [K/32, N]``) -> ``[T, N]``, on CUDA."""
    return int4_grouped_matmul(x, *_one_slot(q, scale, mn), [0], [0, x.shape[0]])


def int4_matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``int4_matmul`` (any device)."""
    return int4_grouped_matmul_reference(x, *_one_slot(q, scale, mn), [0], [0, x.shape[0]])


# --------------------------------------------------------------------------- q8 / mxfp4 (torch on the slots' device)
# The bank layouts restated (devices/ imports nothing else from moed): q8 ``w = qs * d``; mxfp4
# ``w = e2m1(code) * 2**(e8m0 - 127)`` with int4's nibble packing. Each slot a call uses is
# dequantised to float32 once, then multiplied with fp32 accumulation; a dedicated CUDA kernel
# is later work.


def dequantize_q8_slot(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """One slot's ``qs`` int8 ``[K, N]``, ``d`` fp16 ``[K/32, N]`` -> float32 ``W [K, N]`` (exact)."""
    k, n = qs.shape
    return (qs.view(k // BLOCK_GROUP_SIZE, BLOCK_GROUP_SIZE, n).float() * d.float()[:, None]).view(k, n)


def dequantize_mxfp4_slot(fp4: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """One slot's ``fp4`` uint8 ``[K, N/2]``, ``e8m0`` uint8 ``[K/32, N]`` -> float32 ``W [K, N]`` (exact).

    No table: an E2M1 code's magnitude bits placed at fp16 bits 9..11 read as fp16 are its value
    times 2**-14 (E2M1's 0 and 0.5 land on fp16's zero and a subnormal); bit 3 is the sign.
    """
    codes = torch.cat([fp4 & 0x0F, fp4 >> 4], dim=-1).to(torch.int16)  # [K, N]
    magnitude = ((codes & 7) << 9).view(torch.float16).float() * 16384.0
    value = torch.where((codes & 8) != 0, -magnitude, magnitude)
    e = e8m0.to(torch.int32)
    scale = torch.where(e > 0, e << 23, torch.full_like(e, 1 << 22)).view(torch.float32)  # 2**(e - 127)
    k, n = value.shape
    return (value.view(k // BLOCK_GROUP_SIZE, BLOCK_GROUP_SIZE, n) * scale[:, None]).view(k, n)


def _check_block_scaled(x: torch.Tensor, slots: dict[str, torch.Tensor], name: str, fmt: str) -> tuple[int, int, int]:
    """Validate a q8 / mxfp4 slot matrix and ``x``; returns ``(S, K, N)``."""
    suffix, dtype, two_per_byte, scale_suffix, scale_dtype = _BLOCK_SCALED[fmt]
    w = slots[name + suffix]
    if w.dim() != 3 or w.dtype != dtype:
        raise ValueError(f"{fmt} slots {name + suffix!r} must be {dtype} [S, K, N{'/2' if two_per_byte else ''}], "
                         f"got {w.dtype} {tuple(w.shape)}")
    num_slots, k, cols = w.shape
    n = cols * 2 if two_per_byte else cols
    if k % BLOCK_GROUP_SIZE:
        raise ValueError(f"{fmt} slots {name + suffix!r}: K={k} is not a multiple of {BLOCK_GROUP_SIZE}")
    scale = slots.get(name + scale_suffix)
    want = (num_slots, k // BLOCK_GROUP_SIZE, n)
    if scale is None or scale.dtype != scale_dtype or tuple(scale.shape) != want:
        got = "nothing" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
        raise ValueError(f"{fmt} slots need {name + scale_suffix!r} {scale_dtype} {want}, got {got}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != k:
        raise ValueError(f"x must be float32 [T, {k}], got {x.dtype} {tuple(x.shape)}")
    for what, t in ((name + suffix, w), (name + scale_suffix, scale)):
        if t.device != x.device:
            raise ValueError(f"x is on {x.device} but slot tensor {what!r} is on {t.device}")
    return num_slots, k, n


def _block_scaled_format(slots: dict[str, torch.Tensor], name: str) -> str | None:
    for fmt, (suffix, *_rest) in _BLOCK_SCALED.items():
        if name + suffix in slots:
            return fmt
    return None


def slot_matrix_f32(slots: dict[str, torch.Tensor], name: str, slot: int) -> torch.Tensor:
    """Matrix ``name`` of one slot as float32 ``[K, N]`` on the slots' device (fp32 / bf16 / q8 / mxfp4 / int4)."""
    fmt = _block_scaled_format(slots, name)
    if fmt == "q8":
        return dequantize_q8_slot(slots[name + ".qs"][slot], slots[name + ".d"][slot])
    if fmt == "mxfp4":
        return dequantize_mxfp4_slot(slots[name + ".fp4"][slot], slots[name + ".e8m0"][slot])
    if name + ".q" in slots:
        return dequantize_slot(slots[name + ".q"][slot], slots[name + ".scale"][slot], slots[name + ".min"][slot])
    if name not in slots:
        raise ValueError(f"slot storage has no matrix {name!r} (kinds: {sorted(slots)})")
    return slots[name][slot].float()


def _grouped_dense(x: torch.Tensor, slots: dict[str, torch.Tensor], name: str, n: int,
                   slot_ids: Index, offsets: Index) -> torch.Tensor:
    """``y [T, N]``: each expert's token rows times its slot's matrix, dequantised once per used slot."""
    ids = slot_ids.tolist() if isinstance(slot_ids, torch.Tensor) else list(slot_ids)
    offs = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    y = torch.zeros((x.shape[0], n), dtype=torch.float32, device=x.device)  # [T, N]
    dense: dict[int, torch.Tensor] = {}
    for e, s in enumerate(ids):
        a, b = offs[e], offs[e + 1]
        if b > a:
            if s not in dense:
                dense[s] = slot_matrix_f32(slots, name, s)  # [K, N] float32
            y[a:b] = x[a:b] @ dense[s]
    return y


# --------------------------------------------------------------------------- any format


def output_width(slots: dict[str, torch.Tensor], name: str) -> int:
    """N, the output columns of matrix ``name`` in slot storage of any format."""
    if name + ".q" in slots:
        return 2 * slots[name + ".q"].shape[-1]
    fmt = _block_scaled_format(slots, name)
    if fmt is not None:
        suffix, _, two_per_byte, _, _ = _BLOCK_SCALED[fmt]
        return slots[name + suffix].shape[-1] * (2 if two_per_byte else 1)
    if name not in slots:
        raise ValueError(f"slot storage has no matrix {name!r} (kinds: {sorted(slots)})")
    return slots[name].shape[-1]


def grouped_matmul(
    x: torch.Tensor, slots: dict[str, torch.Tensor], name: str, slot_ids: Index, offsets: Index
) -> torch.Tensor:
    """``x [T, K]`` float32 times matrix ``name`` ("gate_up" / "down") of each expert's slot -> ``[T, N]`` float32.

    int4 slots (``name.q``, ``name.scale``, ``name.min``) use the CUDA kernel on CUDA tensors
    (the torch twin elsewhere); fp32/bf16 slots (``name``) use ``torch.matmul`` per expert with
    fp32 accumulation (bf16 weights are widened, matching the CPU path's arithmetic); q8
    (``name.qs``, ``name.d``) and mxfp4 (``name.fp4``, ``name.e8m0``) slots are dequantised to
    float32 with torch ops on their own device, once per slot used, then multiplied the same way.
    """
    if name + ".q" in slots:
        q, scale, mn = slots[name + ".q"], slots[name + ".scale"], slots[name + ".min"]
        fn = int4_grouped_matmul if x.device.type == "cuda" else int4_grouped_matmul_reference
        return fn(x, q, scale, mn, slot_ids, offsets)
    fmt = _block_scaled_format(slots, name)
    if fmt is not None:
        num_slots, _, n = _check_block_scaled(x, slots, name, fmt)
        _check_groups(x.shape[0], num_slots, slot_ids, offsets)
        return _grouped_dense(x, slots, name, n, slot_ids, offsets)
    if name not in slots:
        raise ValueError(f"slot storage has no matrix {name!r} (kinds: {sorted(slots)})")
    w = slots[name]  # [S, K, N]
    if w.dim() != 3 or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"slot matrix {name!r} must be float32 or bfloat16 [S, K, N], got {w.dtype} {tuple(w.shape)}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be float32 [T, {w.shape[1]}], got {x.dtype} {tuple(x.shape)}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but slot matrix {name!r} is on {w.device}")
    _check_groups(x.shape[0], w.shape[0], slot_ids, offsets)
    return _grouped_dense(x, slots, name, w.shape[2], slot_ids, offsets)


# --------------------------------------------------------------------------- GGUF block rows (the ggml bank)


def ggml_kernel_name(ggml_type: int) -> str:
    return f"ggml_rows_matmul_{int(ggml_type)}"


def _ggml_module(device: torch.device) -> Any:
    index = _index_of(device)
    module = _ggml_modules.get(index)
    if module is None:
        cupy = _cupy("the CUDA kernels for GGUF block rows")
        path = kernel_source_path(name=GGML_KERNEL_FILE)
        with cupy.cuda.Device(index):
            module = cupy.RawModule(code=path.read_text(), options=(f"--include-path={path.parent}", "--std=c++14"))
            module.compile()  # now, so a broken toolchain fails here with its own message
        _ggml_modules[index] = module
    return module


def ggml_rows_grouped_matmul(x: torch.Tensor, slots: torch.Tensor, ggml_type: int, rows: int, row_bytes: int,
                             slot_ids: Index, offsets: Index, factor: torch.Tensor | None = None) -> torch.Tensor:
    """``y [T, rows]`` float32: for each expert ``e``, ``x[offsets[e]:offsets[e+1]] @ W.T`` with ``W`` the
    ``rows`` rows of ``row_bytes`` bytes of GGML blocks at the start of slot ``slot_ids[e]`` of ``slots``
    (uint8 ``[S, width]``), decoded in the kernel; times ``factor[slot]`` (float32 ``[S]``) where given. On CUDA;
    the torch twin is experts/ggml_slots.py's decode + matmul (the same values up to summation order)."""
    if ggml_type not in GGML_KERNEL_TYPES:
        raise ValueError(f"no CUDA kernel for GGML type {ggml_type} (kernels: {GGML_KERNEL_TYPES})")
    if x.device.type != "cuda":
        raise ValueError(f"ggml_rows_grouped_matmul runs on CUDA tensors; x is on {x.device}")
    if slots.dim() != 2 or slots.dtype != torch.uint8 or not slots.is_contiguous() or slots.shape[1] < rows * row_bytes:
        raise ValueError(f"slots must be contiguous uint8 [S, >= {rows * row_bytes}], got {slots.dtype} {tuple(slots.shape)}")
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous float32 [T, K], got {x.dtype} {tuple(x.shape)}")
    for what, t in (("slots", slots), ("factor", factor)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{what} is on {t.device} but x is on {x.device}")
    if factor is not None and (factor.dtype != torch.float32 or tuple(factor.shape) != (slots.shape[0],)):
        raise ValueError(f"factor must be float32 [{slots.shape[0]}], got {factor.dtype} {tuple(factor.shape)}")
    _check_groups(x.shape[0], slots.shape[0], slot_ids, offsets)
    y = torch.zeros((x.shape[0], rows), dtype=torch.float32, device=x.device)
    num_experts = len(slot_ids)
    if num_experts == 0 or x.shape[0] == 0 or rows == 0:
        return y
    ids, offs = as_index(slot_ids, "slot_ids", x.device), as_index(offsets, "offsets", x.device)
    kern = _ggml_module(x.device).get_function(ggml_kernel_name(ggml_type))

    import cupy
    import numpy as np

    null = 0  # a null pointer for the kernel's optional factor
    with cupy.cuda.Device(x.device.index), _cupy_stream(cupy, torch.cuda.current_stream(x.device)):
        grid = ((rows + GGML_WARPS - 1) // GGML_WARPS, num_experts)
        kern(grid, (GGML_WARPS * 32,),
             (cupy.from_dlpack(x), cupy.from_dlpack(slots), np.int64(slots.shape[1]), cupy.from_dlpack(ids),
              cupy.from_dlpack(offs), cupy.from_dlpack(factor) if factor is not None else np.uintp(null),
              cupy.from_dlpack(y), np.int32(rows), np.int32(x.shape[1]), np.int32(row_bytes)))
    return y
