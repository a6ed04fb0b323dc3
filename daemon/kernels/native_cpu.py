"""moed's native CPU kernels (native/cpu/*.c, built by `pip install`): loading, ISA choice, calls.

The library is plain C (SIMD per function, chosen at run time: AVX-512 with VNNI (vpdpbusd for the
int8 strips), AVX-512, AVX2 or a portable scalar path) loaded with ctypes; it owns one persistent thread pool. Entry points:

- ``moe(bank, x, flat_ids, weights)``: every routed expert of one MoE layer in one call (gate_up,
  activation, down, the weighted sum in ascending slot order), reading the bank by flat id;
- ``dense_bf16(x, weight)``: ``x @ weight.T`` for bf16 ``nn.Linear`` weights (attention, lm_head);
  ``dense_bf16_many(x, weights)`` does several that share ``x`` (q, k, v) in one call;
- ``rows_many(dtype, matrices, x)``: the same for q8/int4 weights in the rows layout (a quantised
  GGUF's attention and lm_head, kernels/rows_format.py), activations quantised to int8 once;
- ``route(...)``: the softmax / top-k-softmax router at decode (logits, softmax, top-k) in one call;
- ``attn_decode(...)``: decode attention after the projections (norms, rotary, KV write, softmax);
- ``strip(...)``: one strip kernel with a chosen ISA, for the tests against the torch twins
  (moed.kernels.native_cpu_reference).

Without the library (no compiler at install, ``MOED_NATIVE=0``) ``native()`` is None and the
callers use the numba kernels. ``MOED_NATIVE_ISA=scalar|avx2|avx512|avx512vnni`` caps the ISA (never above
what the CPU has).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from moed.kernels.cpu_threads import cpu_threads
from moed.kernels.ggml_rows_format import check_rows, row_bytes
from moed.kernels.ggml_x8_format import base_type, is_x8
from moed.kernels.rows_format import rows_shapes

ABI_VERSION = 8
ISA_NAMES = ("scalar", "avx2", "avx512", "avx512vnni")
# the GGUF block kernels at AVX-512 VNNI come in 256-bit and 512-bit forms (the CPU's vector width picks one:
# moed_cpu_vector_bits); these two names take one of them whatever the CPU prefers (MOED_GGML_ISA_VNNI256/512)
GGML_ISA_NAMES = ISA_NAMES + ("avx512vnni256", "avx512vnni512")
DTYPE_CODES = {"fp32": 0, "bf16": 1, "int4": 2, "q8": 3, "mxfp4": 4}
ROWS_CODES = {"q8": 3, "int4": 2, "fp8": 16}  # row-major matrices (moed_cpu_rows_many; MOED_ROWS_FP8)
ROWS_GGML = 17  # a decode-chain linear kept as GGUF block rows (MOED_ROWS_GGML)
ACT_CODES = {"silu": 0, "gpt_oss": 1, "clamped_silu": 2, "relu2": 3, "gelu_tanh": 4}  # moed_activate's kinds
SPIN_NS = int(float(os.environ.get("MOED_SPIN_US", "30")) * 1000)  # idle threads spin this long, then sleep
MAX_DENSE = 8  # weights per dense_bf16_many call (MOED_DENSE_MAX in moe.c)
MAX_TOKENS = 16  # the native MoE path serves decode and small batches; more tokens go to torch GEMMs


class _Matrix(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("s", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("K", ctypes.c_int64), ("N", ctypes.c_int64)]


class _Bank(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("act_kind", ctypes.c_int32), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float), ("D", ctypes.c_int64), ("I", ctypes.c_int64),
                ("num_slots", ctypes.c_int64),
                ("gu_w", ctypes.c_void_p), ("gu_s", ctypes.c_void_p), ("gu_m", ctypes.c_void_p),
                ("dn_w", ctypes.c_void_p), ("dn_s", ctypes.c_void_p), ("dn_m", ctypes.c_void_p),
                ("gu_w_stride", ctypes.c_int64), ("gu_s_stride", ctypes.c_int64),
                ("dn_w_stride", ctypes.c_int64), ("dn_s_stride", ctypes.c_int64),
                ("gu_bias", ctypes.c_void_p), ("dn_bias", ctypes.c_void_p)]


class _GgmlMatrix(ctypes.Structure):
    """native/cpu/ggml_rows.h moed_ggml_matrix: rows of GGUF blocks."""
    _fields_ = [("w", ctypes.c_void_p), ("type", ctypes.c_int32), ("rows", ctypes.c_int64), ("K", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64)]


class _GgmlLayer(ctypes.Structure):
    """native/cpu/ggml_moe.c moed_ggml_layer: one MoE layer of a ggml bank."""
    _fields_ = [("gate", _GgmlMatrix), ("up", _GgmlMatrix), ("down", _GgmlMatrix), ("E", ctypes.c_int64),
                ("act_kind", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("gate_up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p),
                ("gate_scale", ctypes.c_void_p), ("up_scale", ctypes.c_void_p), ("down_scale", ctypes.c_void_p)]


def ggml_layer(bank, moe_layer: int) -> _GgmlLayer:
    """The native description of one MoE layer of a ggml bank (valid while the bank lives). Kept on the bank per
    layer, keyed by its matrices' addresses, shapes and types (a layout change in place, cpu_layout's, makes a
    new one): building and checking it took ~20 us of a decode call's Python."""
    mats = [bank.ggml_matrix(kind, moe_layer) for kind in ("gate", "up", "down")]
    key = (moe_layer, *((t.data_ptr(), tuple(t.shape), ggml_type) for t, ggml_type in mats))
    cache = bank.__dict__.setdefault("_native_ggml_layers", {})
    layer = cache.get(key)
    if layer is None:
        layer = cache[key] = _build_ggml_layer(bank, moe_layer, mats)
    return layer


def _build_ggml_layer(bank, moe_layer: int, found: list) -> _GgmlLayer:
    mats = []
    for (t, ggml_type), k in zip(found, (bank.hidden_size, bank.hidden_size, bank.intermediate_size)):
        kind = ("gate", "up", "down")[len(mats)]
        experts, rows, width = t.shape
        if width != row_bytes(ggml_type, k) or not t.is_contiguous():
            raise ValueError(f"ggml bank {kind}.{moe_layer}: {tuple(t.shape)} is not {experts} experts of "
                             f"{rows} contiguous rows of {k} weights")
        mats.append(_GgmlMatrix(t.data_ptr(), ggml_type, rows, k, width))
    e = bank.num_experts
    gu = bank.tensors.get("gate_up_bias")
    dn = bank.tensors.get("down_bias")
    act = bank.activation
    scales = [bank.ggml_scale(kind, moe_layer) for kind in ("gate", "up", "down")]
    for kind, s in zip(("gate", "up", "down"), scales):
        if s is not None and (s.dtype != torch.float32 or tuple(s.shape) != (e,) or not s.is_contiguous()):
            raise ValueError(f"ggml bank {kind}.{moe_layer}.scale: {s.dtype} {tuple(s.shape)} is not contiguous "
                             f"float32 [{e}]")
    return _GgmlLayer(*mats, e, ACT_CODES[act.kind], act.alpha,
                      act.limit if math.isfinite(act.limit) else 3.0e38,
                      None if gu is None else gu.data_ptr() + moe_layer * e * gu.shape[1] * 4,
                      None if dn is None else dn.data_ptr() + moe_layer * e * dn.shape[1] * 4,
                      *[None if s is None else s.data_ptr() for s in scales])


def _moe_args(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None, per_slot: torch.Tensor | None,
              merge: bool, hidden: int, limit: int, what: str):
    """The checked arguments of a native MoE call: ``(x, ids int32 [N, A], weights or None, y or None)``;
    ids are -1 (not run here) or below ``limit``."""
    x = _f32_rows(x, "x")
    if x.shape[1] != hidden:
        raise ValueError(f"x must be [N, {hidden}], got {tuple(x.shape)}")
    ids = ids.to(torch.int32).contiguous()
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{what} must be [{x.shape[0]}, A], got {tuple(ids.shape)}")
    n, a = ids.shape
    w = None
    if weights is not None:
        w = weights.to(torch.float32).contiguous()
        if tuple(w.shape) != (n, a):
            raise ValueError(f"weights must be [{n}, {a}], got {tuple(w.shape)}")
    elif merge:
        raise ValueError("merging needs the routing weights")
    if per_slot is not None and (per_slot.dtype != torch.float32 or tuple(per_slot.shape) != (n, a, hidden)
                                 or not per_slot.is_contiguous()):
        raise ValueError(f"per_slot must be contiguous float32 [{n}, {a}, {hidden}]")
    return x, ids, w, (torch.empty(n, hidden, dtype=torch.float32) if merge else None)


def _ids_error(ids: torch.Tensor, limit: int, what: str, rc: int) -> ValueError:
    """The error of a native MoE call that refused its arguments (the library checks the ids' range: the
    message names it)."""
    if ids.numel() and (int(ids.max()) >= limit or int(ids.min()) < -1):
        return ValueError(f"{what} out of range: they must be -1 .. {limit - 1}, got {int(ids.min())} .. {int(ids.max())}")
    return ValueError(f"the native MoE kernel refused its arguments (rc {rc})")


def library_path() -> Path | None:
    """The built library beside this package (editable or installed), or None."""
    here = Path(__file__).resolve().parent.parent
    found = sorted(glob.glob(str(here / "_cpu_kernels*.so"))) + sorted(glob.glob(str(here / "_cpu_kernels*.pyd")))
    return Path(found[0]) if found else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _f32_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"{what} must be float32 [T, K] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
    return x.contiguous()


@dataclass(frozen=True)
class BankDescriptor:
    """A bank's arrays as the library takes them; keeps the tensors alive while in use."""

    struct: _Bank
    tensors: tuple[torch.Tensor, ...]
    dtype: str
    hidden: int
    inter: int
    num_slots: int


class _AttnDecode(ctypes.Structure):  # moed_attn_decode_args (native/cpu/attn_decode.h)
    _fields_ = [("B", ctypes.c_int32), ("H", ctypes.c_int32), ("Hk", ctypes.c_int32), ("Dh", ctypes.c_int32),
                ("Dv", ctypes.c_int32), ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("rot_dim", ctypes.c_int32), ("interleaved", ctypes.c_int32),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("block_size", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64), ("kv_type", ctypes.c_int32), ("max_blocks", ctypes.c_int32),
                ("block_table", ctypes.c_void_p), ("start", ctypes.c_void_p), ("pos", ctypes.c_void_p),
                ("length", ctypes.c_void_p), ("num_keys", ctypes.c_int64), ("window", ctypes.c_int64),
                ("scale", ctypes.c_float), ("sinks", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("chunk", ctypes.c_int64)]


KV_TYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # MOED_KV_* (attn_decode.h); int8: q8_0


class _Linear(ctypes.Structure):  # moed_linear (native/cpu/decode_chain.c)
    _fields_ = [("dtype", ctypes.c_int32), ("ggml_type", ctypes.c_int32), ("m", _Matrix), ("bias", ctypes.c_void_p)]


class ChainLayer(ctypes.Structure):  # moed_chain_layer (native/cpu/decode_chain.c)
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("in_norm_bf16", ctypes.c_int32),
                ("post_norm_bf16", ctypes.c_int32), ("q", _Linear), ("k", _Linear), ("v", _Linear), ("o", _Linear),
                ("attn", _AttnDecode), ("router_w", ctypes.c_void_p), ("router_b", ctypes.c_void_p),
                ("E", ctypes.c_int64), ("router_bf16", ctypes.c_int32), ("router_kind", ctypes.c_int32), ("top_k", ctypes.c_int32),
                ("renormalise", ctypes.c_int32), ("flat_base", ctypes.c_int32), ("bank", ctypes.POINTER(_Bank)),
                ("mlp_gate", _Linear), ("mlp_up", _Linear), ("mlp_down", _Linear), ("mlp_scale", _Linear),
                ("ggml", ctypes.c_void_p)]


class _ChainStep(ctypes.Structure):  # moed_chain_step (native/cpu/decode_chain.c)
    _fields_ = [("B", ctypes.c_int32), ("D", ctypes.c_int64), ("eps", ctypes.c_float), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("block_table", ctypes.c_void_p), ("max_blocks", ctypes.c_int32),
                ("start", ctypes.c_void_p),
                ("pos", ctypes.c_void_p), ("length", ctypes.c_void_p), ("num_keys", ctypes.c_int64)]


class ChainHead(ctypes.Structure):  # moed_chain_head (native/cpu/decode_chain.c)
    _fields_ = [("norm", ctypes.c_void_p), ("norm_bf16", ctypes.c_int32), ("lm_head", _Linear),
                ("logits", ctypes.c_void_p)]


def linear_struct(weight, bias: torch.Tensor | None) -> tuple["_Linear", tuple[torch.Tensor, ...]]:
    """A decode-chain linear for a bf16 ``[N, K]`` weight or a PackedLinear (duck-typed: ``dtype``, ``arrays``,
    ``in_features``, ``out_features``, ``ggml_type``: q8/int4/fp8 rows, or GGUF block rows and their factor);
    the bias (any float dtype) as float32. Returns the struct and the tensors it points into (keep them alive)."""
    b = None if bias is None else bias.detach().float().contiguous()
    if isinstance(weight, torch.Tensor):
        m = _Matrix(weight.data_ptr(), None, None, weight.shape[1], weight.shape[0])
        return _Linear(DTYPE_CODES["bf16"], 0, m, _ptr(b)), tuple(t for t in (weight, b) if t is not None)
    arrays = weight.arrays
    m = _Matrix(arrays[0].data_ptr(), arrays[1].data_ptr(), arrays[2].data_ptr() if len(arrays) > 2 else None,
                weight.in_features, weight.out_features)
    ggml_type = getattr(weight, "ggml_type", None)
    code = ROWS_GGML if ggml_type is not None else ROWS_CODES[weight.dtype]
    return _Linear(code, ggml_type or 0, m, _ptr(b)), tuple(arrays) + ((b,) if b is not None else ())


CHAIN_PARTS = ("projections", "attention", "router", "experts", "norms and adds", "final norm + lm_head")  # timings


class NativeCpu:
    """The loaded library and its thread pool. Calls are serialised (one pool, one job at a time)."""

    def __init__(self, path: Path, num_threads: int | None = None, isa: str | None = None) -> None:
        lib = ctypes.CDLL(str(path))
        self._lib = lib
        self.path = path
        c_i64, c_int, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.moed_cpu_abi_version.restype = c_int
        if lib.moed_cpu_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path} is from another moed version (ABI {lib.moed_cpu_abi_version()}, "
                               f"expected {ABI_VERSION}); reinstall moed (pip install -e .)")
        lib.moed_cpu_create.restype = vp
        lib.moed_cpu_create.argtypes = [c_int, c_i64]
        lib.moed_cpu_destroy.argtypes = [vp]
        lib.moed_cpu_threads.argtypes = [vp]
        lib.moed_cpu_detected_isa.restype = c_int
        lib.moed_cpu_vector_bits.restype = c_int
        lib.moed_cpu_set_isa.argtypes = [c_int]
        lib.moed_cpu_set_isa.restype = c_int
        lib.moed_cpu_isa.restype = c_int
        lib.moed_cpu_strip.argtypes = [c_int, c_int, ctypes.POINTER(_Matrix), vp, c_int, c_i64, c_i64, vp, vp, c_i64]
        lib.moed_cpu_strip.restype = c_int
        lib.moed_cpu_dense_bf16.argtypes = [vp, vp, c_i64, c_i64, vp, c_int, vp]
        lib.moed_cpu_dense_bf16.restype = c_int
        lib.moed_cpu_dense_bf16_many.argtypes = [vp, c_int, vp, vp, c_i64, vp, c_int, vp]
        lib.moed_cpu_dense_bf16_many.restype = c_int
        lib.moed_cpu_moe.argtypes = [vp, ctypes.POINTER(_Bank), vp, c_int, c_int, vp, vp, vp, vp]
        lib.moed_cpu_moe.restype = c_int
        lib.moed_cpu_rows_many.argtypes = [vp, c_int, c_int, vp, vp, c_int, vp]
        lib.moed_cpu_rows_many.restype = c_int
        lib.moed_add_rms_norm.argtypes = [vp, vp, vp, c_int, c_i64, c_i64, ctypes.c_float, vp, vp]
        lib.moed_add_rms_norm.restype = c_int
        lib.moed_cpu_route.argtypes = [vp, vp, c_i64, c_i64, vp, vp, c_i64, c_int, c_int, c_int, vp, vp]
        lib.moed_cpu_route.restype = c_int
        lib.moed_swiglu.argtypes = [vp, vp, c_i64, vp]
        lib.moed_swiglu.restype = c_int
        lib.moed_sigmoid_scale.argtypes = [vp, c_i64, c_i64, vp]
        lib.moed_sigmoid_scale.restype = c_int
        lib.moed_route_select.argtypes = [vp, c_i64, c_i64, c_int, c_int, c_int, vp, vp]
        lib.moed_route_select.restype = c_int
        for fn in (lib.moed_cpu_rows_to_bf16, lib.moed_cpu_rows_to_f32):
            fn.argtypes = [vp, c_int, ctypes.POINTER(_Matrix), vp]
            fn.restype = c_int
        lib.moed_cpu_attn_decode.argtypes = [vp, ctypes.POINTER(_AttnDecode)]
        lib.moed_cpu_attn_decode.restype = c_int
        lib.moed_cpu_ggml_rows.argtypes = [vp, c_int, vp, vp, c_int, c_i64, vp]
        lib.moed_cpu_ggml_rows.restype = c_int
        lib.moed_cpu_ggml_moe.argtypes = [vp, ctypes.POINTER(_GgmlLayer), vp, c_int, c_int, vp, vp, vp, vp]
        lib.moed_cpu_ggml_moe.restype = c_int
        for fn in (lib.moed_cpu_ggml_to_bf16, lib.moed_cpu_ggml_to_f32):
            fn.argtypes = [vp, ctypes.POINTER(_GgmlMatrix), vp]
            fn.restype = c_int
        lib.moed_cpu_ggml_x8_convert.argtypes = [vp, c_int, c_int, vp, c_i64, c_i64, vp]
        lib.moed_cpu_ggml_x8_convert.restype = c_int
        lib.moed_ggml_x8_preferred.argtypes = [c_int, c_int]
        lib.moed_ggml_x8_preferred.restype = c_int
        lib.moed_ggml_dot8_one.argtypes = [c_int, c_int, vp, c_i64, vp, vp, vp, c_int, vp]
        lib.moed_ggml_dot8_one.restype = c_int
        lib.moed_cpu_read_pass.argtypes = [vp, vp, c_i64]
        lib.moed_cpu_read_pass.restype = ctypes.c_uint64
        lib.moed_quantize_act_span_isa.argtypes = [c_int, vp, c_int, c_i64, c_int, vp, vp, vp]
        lib.moed_quantize_act_span_isa.restype = None
        lib.moed_activate_row_isa.argtypes = [c_int, c_int, vp, vp, c_i64, ctypes.c_float, ctypes.c_float, vp, vp,
                                              ctypes.c_float, ctypes.c_float, vp]
        lib.moed_activate_row_isa.restype = None
        lib.moed_ggml_act_span.argtypes = [c_int]
        lib.moed_ggml_act_span.restype = c_int
        lib.moed_ggml_dot_one.argtypes = [c_int, c_int, vp, c_i64, vp, vp, vp, c_int, vp]
        lib.moed_ggml_dot_one.restype = c_int
        lib.moed_ggml_fdot_one.argtypes = [c_int, c_int, vp, c_i64, vp, c_int, vp]
        lib.moed_ggml_fdot_one.restype = c_int
        lib.moed_chain_work_floats.argtypes = [ctypes.POINTER(ChainLayer), c_int, c_int, c_i64]
        lib.moed_chain_work_floats.restype = c_i64
        lib.moed_cpu_decode_layers.argtypes = [vp, ctypes.POINTER(ChainLayer), c_int, ctypes.POINTER(_ChainStep), vp,
                                               ctypes.POINTER(ChainHead), vp, c_i64, vp, vp, vp]
        lib.moed_cpu_decode_layers.restype = c_int
        self.detected_isa = ISA_NAMES[lib.moed_cpu_detected_isa()]
        if isa is not None and isa not in ISA_NAMES:
            raise ValueError(f"MOED_NATIVE_ISA={isa!r} is not one of {', '.join(ISA_NAMES)}")
        # the ISA is process-wide: set it only when asked (another handle may have chosen one)
        self.isa = ISA_NAMES[lib.moed_cpu_set_isa(ISA_NAMES.index(isa)) if isa else lib.moed_cpu_isa()]
        self.num_threads = max(1, num_threads or cpu_threads())
        self._pool = lib.moed_cpu_create(self.num_threads, SPIN_NS)
        if not self._pool:
            raise RuntimeError("the native CPU kernels could not start their threads")
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        return f"native-{self.isa}"

    def set_isa(self, isa: str | None) -> str:
        """Use ``isa`` (None: the best the CPU has) from now on, process-wide; returns the previous one."""
        previous = self.isa
        with self._lock:
            code = ISA_NAMES.index(isa) if isa is not None else -1
            self.isa = ISA_NAMES[self._lib.moed_cpu_set_isa(code)]
        return previous

    def available_isas(self) -> tuple[str, ...]:
        return ISA_NAMES[: ISA_NAMES.index(self.detected_isa) + 1]

    def available_ggml_isas(self) -> tuple[str, ...]:
        """The ISAs of ``ggml_dot_one``: available_isas and, with AVX-512 VNNI, both widths of its kernels."""
        return self.available_isas() + (GGML_ISA_NAMES[4:] if self.detected_isa == "avx512vnni" else ())

    @property
    def vector_bits(self) -> int:
        """256 where the CPU runs 512-bit instructions as two halves (the GGUF kernels then use 256 bits)."""
        return int(self._lib.moed_cpu_vector_bits())

    def close(self) -> None:
        with self._lock:
            if self._pool:
                self._lib.moed_cpu_destroy(self._pool)
                self._pool = None

    # ------------------------------------------------------------------ dense
    def dense_bf16(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x [T, K]`` float32 @ ``weight [N, K]`` bf16 ``.T`` -> ``[T, N]`` float32 (fp32 accumulation)."""
        return self.dense_bf16_many(x, (weight,))[0]

    def dense_bf16_many(self, x: torch.Tensor, weights: "tuple[torch.Tensor, ...] | list[torch.Tensor]"
                        ) -> list[torch.Tensor]:
        """``[x @ w.T for w in weights]`` in one call (x prepared once, the rows of all the weights
        shared out over the threads): bit for bit what separate ``dense_bf16`` calls give."""
        x = _f32_rows(x, "x")
        count = len(weights)
        if not 1 <= count <= MAX_DENSE:
            raise ValueError(f"dense_bf16_many takes 1 to {MAX_DENSE} weights, got {count}")
        for weight in weights:
            if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous() \
                    or weight.shape[1] != x.shape[1] or weight.device.type != "cpu":
                raise ValueError(f"weight must be contiguous bf16 [N, {x.shape[1]}] in host memory, "
                                 f"got {weight.dtype} {tuple(weight.shape)}")
        ys = [torch.empty(x.shape[0], w.shape[0], dtype=torch.float32) for w in weights]
        ptrs = (ctypes.c_void_p * count)(*(w.data_ptr() for w in weights))
        rows = (ctypes.c_int64 * count)(*(w.shape[0] for w in weights))
        outs = (ctypes.c_void_p * count)(*(y.data_ptr() for y in ys))
        with self._lock:
            rc = self._lib.moed_cpu_dense_bf16_many(self._pool, count, ptrs, rows, x.shape[1], x.data_ptr(),
                                                    x.shape[0], outs)
        if rc != 0:
            raise ValueError(f"moed_cpu_dense_bf16_many refused its arguments (rc {rc})")
        return ys

    # ------------------------------------------------------------------ norms
    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., D]`` (+ ``delta``) float32 -> ``(x + delta, rms_norm(x + delta, weight))``; without
        ``delta`` the first is ``x`` itself. Runs on the calling thread (no pool, no lock needed)."""
        d = x.shape[-1]
        ok = x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
        ok = ok and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous() \
            and tuple(weight.shape) == (d,) and weight.device.type == "cpu"
        if delta is not None:
            ok = ok and delta.dtype == torch.float32 and delta.is_contiguous() and delta.shape == x.shape
        if not ok:
            raise ValueError("add_rms_norm: contiguous float32 x (and delta) [..., D] and a [D] float32/bf16 weight")
        h = torch.empty_like(x)
        out = torch.empty_like(x) if delta is not None else x
        rc = self._lib.moed_add_rms_norm(x.data_ptr(), _ptr(delta), weight.data_ptr(), int(weight.dtype == torch.bfloat16),
                                         x.numel() // d, d, eps, out.data_ptr() if delta is not None else None,
                                         h.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_add_rms_norm refused its arguments (rc {rc})")
        return out, h

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` elementwise, float32 (the MoE kernel's activation arithmetic), on the
        calling thread: dense MLPs and shared experts at decode."""
        if gate.dtype != torch.float32 or up.dtype != torch.float32 or gate.shape != up.shape \
                or gate.device.type != "cpu" or up.device.type != "cpu":
            raise ValueError("swiglu: float32 gate and up of one shape in host memory")
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        if self._lib.moed_swiglu(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr()) != 0:
            raise ValueError("moed_swiglu refused its arguments")
        return out

    def sigmoid_scale(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``sigmoid(z) * y`` for ``z [..., 1]`` and ``y [..., D]`` float32 (a shared expert's gate)."""
        d = y.shape[-1]
        if z.dtype != torch.float32 or y.dtype != torch.float32 or z.shape[-1] != 1 \
                or z.numel() * d != y.numel() or z.device.type != "cpu" or y.device.type != "cpu":
            raise ValueError("sigmoid_scale: float32 z [..., 1] and y [..., D] in host memory")
        out = y.contiguous().clone()
        if self._lib.moed_sigmoid_scale(z.contiguous().data_ptr(), z.numel(), d, out.data_ptr()) != 0:
            raise ValueError("moed_sigmoid_scale refused its arguments")
        return out

    # ------------------------------------------------------------------ router
    ROUTER_KINDS = {"softmax": 0, "topk_softmax": 1}

    def route(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring: str, top_k: int,
              renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, D]`` float32, router ``weight [E, D]`` float32 -> ``(ids int64 [N, A], weights float32
        [N, A])`` as ``moed.layers.moe.route`` computes them for ``scoring`` softmax / topk_softmax."""
        x = _f32_rows(x, "x")
        if weight.dtype != torch.float32 or weight.dim() != 2 or not weight.is_contiguous() \
                or weight.shape[1] != x.shape[1] or weight.device.type != "cpu":
            raise ValueError(f"router weight must be contiguous float32 [E, {x.shape[1]}] in host memory")
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (weight.shape[0],)
                                 or not bias.is_contiguous()):
            raise ValueError(f"router bias must be contiguous float32 [{weight.shape[0]}]")
        if scoring not in self.ROUTER_KINDS:
            raise ValueError(f"router scoring {scoring!r} is not one of {', '.join(self.ROUTER_KINDS)}")
        n, e = x.shape[0], weight.shape[0]
        ids = torch.empty(n, top_k, dtype=torch.int64)
        weights = torch.empty(n, top_k, dtype=torch.float32)
        with self._lock:
            rc = self._lib.moed_cpu_route(self._pool, x.data_ptr(), n, x.shape[1], weight.data_ptr(), _ptr(bias), e,
                                          self.ROUTER_KINDS[scoring], top_k, int(renormalise), ids.data_ptr(),
                                          weights.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_cpu_route refused its arguments (rc {rc})")
        return ids, weights

    def route_select(self, logits: torch.Tensor, scoring: str, top_k: int, renormalise: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The choice part of ``route`` on given router logits ``[N, E]`` float32 (a bf16 router's, from
        the dense GEMV): the same softmax / top-k code. Runs on the calling thread."""
        logits = _f32_rows(logits, "logits").clone()  # overwritten with the probabilities
        if scoring not in self.ROUTER_KINDS:
            raise ValueError(f"router scoring {scoring!r} is not one of {', '.join(self.ROUTER_KINDS)}")
        n, e = logits.shape
        ids = torch.empty(n, top_k, dtype=torch.int64)
        weights = torch.empty(n, top_k, dtype=torch.float32)
        rc = self._lib.moed_route_select(logits.data_ptr(), n, e, self.ROUTER_KINDS[scoring], top_k, int(renormalise),
                                         ids.data_ptr(), weights.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_route_select refused its arguments (rc {rc})")
        return ids, weights

    # ------------------------------------------------------------------ decode attention
    def attn_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, rot_dim: int,
                    interleaved: bool, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, starts: list[int], positions: list[int],
                    lengths: list[int], num_keys: int, window: int | None, scale: float,
                    sinks: torch.Tensor | None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        """One new token per row: q [B, H*Dh], k [B, Hk*Dh], v [B, Hk*Dv] float32 -> attention output
        [B, H*Dv] (the input of o_proj), storing the normalised, rotated k and v in the paged pools
        [num_blocks, block_size, Hk, Dh|Dv] (float32, bfloat16, or int8 q8_0 with ``k_scale`` / ``v_scale``
        float16 [num_blocks, block_size, Hk, Dh|Dv / 32]: cache/q8_0.py) through ``block_tables``
        [B, max_blocks] int32 at ``starts``. See native/cpu/attn_decode.h."""
        rows = q.shape[0]
        dh, dv = q.shape[1] // num_heads, v.shape[1] // num_kv_heads
        f32 = [q, k, v, cos, sin] + [t for t in (q_norm, k_norm, sinks) if t is not None]
        if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in f32):
            raise ValueError("attn_decode: tensors must be contiguous float32 in host memory")
        if (k_cache.dtype not in KV_TYPE_CODES or v_cache.dtype != k_cache.dtype
                or not k_cache.is_contiguous() or not v_cache.is_contiguous() or k_cache.device.type != "cpu"
                or v_cache.device.type != "cpu"):
            raise ValueError("attn_decode: the KV pools must be contiguous float32, bfloat16 or int8 in host memory")
        quantized = k_cache.dtype == torch.int8
        if quantized != (k_scale is not None) or quantized != (v_scale is not None) or (quantized and (
                k_scale.dtype != torch.float16 or v_scale.dtype != torch.float16 or not k_scale.is_contiguous()
                or not v_scale.is_contiguous() or k_scale.shape != (*k_cache.shape[:3], dh // 32)
                or v_scale.shape != (*v_cache.shape[:3], dv // 32) or dh % 32 or dv % 32)):
            raise ValueError("attn_decode: an int8 (q8_0) pool needs float16 scales [blocks, block_size, Hk, D/32] "
                             "and head dims of a multiple of 32; other pools take none")
        if (block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != rows
                or not block_tables.is_contiguous()):
            raise ValueError(f"attn_decode: block_tables must be contiguous int32 [{rows}, max_blocks]")
        if (q.shape != (rows, num_heads * dh) or k.shape != (rows, num_kv_heads * dh)
                or v.shape != (rows, num_kv_heads * dv) or k_cache.shape[2:] != (num_kv_heads, dh)
                or v_cache.shape[:3] != k_cache.shape[:3] or v_cache.shape[3] != dv
                or cos.shape != (rows, rot_dim // 2) or sin.shape != cos.shape
                or (q_norm is not None and q_norm.shape != (dh,)) or (k_norm is not None and k_norm.shape != (dh,))
                or (sinks is not None and sinks.shape != (num_heads,))):
            raise ValueError("attn_decode: inconsistent shapes")
        out = torch.empty(rows, num_heads * dv, dtype=torch.float32)
        ints = torch.tensor([starts, positions], dtype=torch.int64)
        lens = torch.tensor(lengths, dtype=torch.int32)
        args = _AttnDecode(rows, num_heads, num_kv_heads, dh, dv, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                           _ptr(q_norm), _ptr(k_norm), eps, rot_dim, int(interleaved), cos.data_ptr(),
                           sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
                           k_cache.shape[0], KV_TYPE_CODES[k_cache.dtype], block_tables.shape[1],
                           block_tables.data_ptr(), ints[0].data_ptr(), ints[1].data_ptr(), lens.data_ptr(),
                           num_keys, window or 0, scale, _ptr(sinks), out.data_ptr(), _ptr(k_scale), _ptr(v_scale),
                           chunk or 0)
        with self._lock:
            rc = self._lib.moed_cpu_attn_decode(self._pool, ctypes.byref(args))
        if rc != 0:
            raise ValueError(f"moed_cpu_attn_decode refused its arguments (rc {rc})")
        return out

    # ------------------------------------------------------------------ one matrix in a bank format
    def rows_many(self, dtype: str, matrices: "list[tuple[torch.Tensor, ...]] | tuple", x: torch.Tensor
                  ) -> list[torch.Tensor]:
        """``x [T, K]`` float32 times each ``[N, K]`` matrix stored as ``arrays`` in the rows layout of
        ``dtype`` (kernels/rows_format.py: q8 or int4) -> ``[x @ w.T]`` float32 ``[T, N]`` each. One
        call: x is quantised to int8 once for all (an attention layer's q, k and v)."""
        x = _f32_rows(x, "x")
        if dtype not in ROWS_CODES:
            raise ValueError(f"rows_many: dtype must be q8, int4 or fp8, got {dtype!r}")
        count = len(matrices)
        if not 1 <= count <= MAX_DENSE:
            raise ValueError(f"rows_many takes 1 to {MAX_DENSE} matrices, got {count}")
        k = x.shape[1]
        mats, ys = [], []
        for arrays in matrices:
            shapes = rows_shapes(dtype, k, arrays[0].shape[0])
            if len(arrays) != len(shapes) or any(
                    tuple(t.shape) != shape or t.dtype != tdtype or not t.is_contiguous() or t.device.type != "cpu"
                    for t, (shape, tdtype) in zip(arrays, shapes)):
                raise ValueError(f"rows_many: a {dtype} matrix for x [T, {k}] must be contiguous host arrays "
                                 f"{[(list(s), str(d)) for s, d in shapes]}")
            n = arrays[0].shape[0]
            mats.append(_Matrix(arrays[0].data_ptr(), arrays[1].data_ptr(),
                                arrays[2].data_ptr() if len(arrays) > 2 else None, k, n))
            ys.append(torch.empty(x.shape[0], n, dtype=torch.float32))
        ptrs = (ctypes.POINTER(_Matrix) * count)(*(ctypes.pointer(m) for m in mats))
        outs = (ctypes.c_void_p * count)(*(y.data_ptr() for y in ys))
        with self._lock:
            rc = self._lib.moed_cpu_rows_many(self._pool, ROWS_CODES[dtype], count, ptrs, x.data_ptr(), x.shape[0],
                                              outs)
        if rc != 0:
            raise MemoryError("the native rows kernel ran out of memory") if rc == -2 else \
                ValueError(f"moed_cpu_rows_many refused its arguments (rc {rc})")
        return ys

    def ggml_rows(self, matrices: "list[tuple[torch.Tensor, int]] | tuple", x: torch.Tensor) -> list[torch.Tensor]:
        """``x [T, K]`` float32 times each matrix of GGUF block rows ``(raw uint8 [rows, row_bytes], ggml
        type)`` (kernels/ggml_rows_format.py) -> ``[x @ w.T]`` float32 ``[T, rows]`` each; x is quantised
        to int8 once for all."""
        x = _f32_rows(x, "x")
        count, k = len(matrices), x.shape[1]
        if not 1 <= count <= MAX_DENSE:
            raise ValueError(f"ggml_rows takes 1 to {MAX_DENSE} matrices, got {count}")
        mats, ys = [], []
        for raw, ggml_type in matrices:
            rows = check_rows(raw, ggml_type, k, "ggml_rows")
            if not raw.is_contiguous() or raw.device.type != "cpu":
                raise ValueError("ggml_rows: the rows must be a contiguous host tensor")
            mats.append(_GgmlMatrix(raw.data_ptr(), ggml_type, rows, k, raw.shape[1]))
            ys.append(torch.empty(x.shape[0], rows, dtype=torch.float32))
        ptrs = (ctypes.POINTER(_GgmlMatrix) * count)(*(ctypes.pointer(m) for m in mats))
        outs = (ctypes.c_void_p * count)(*(y.data_ptr() for y in ys))
        with self._lock:
            rc = self._lib.moed_cpu_ggml_rows(self._pool, count, ptrs, x.data_ptr(), x.shape[0], k, outs)
        if rc != 0:
            raise MemoryError("the native ggml rows kernel ran out of memory") if rc == -2 else \
                ValueError(f"moed_cpu_ggml_rows refused its arguments (rc {rc})")
        return ys

    def ggml_x8_preferred(self, ggml_type: int) -> int:
        """The x8 layout (kernels/ggml_x8_format.py) whose kernels run ``ggml_type`` faster at the current ISA,
        or 0 (keep the rows)."""
        return int(self._lib.moed_ggml_x8_preferred(int(ggml_type), ISA_NAMES.index(self.isa)))

    def ggml_x8_convert(self, raw: torch.Tensor, ggml_type: int, k: int, *, pack: bool,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """GGUF rows of ``ggml_type`` (``uint8 [..., rows, row_bytes]``, rows a multiple of 8) -> the x8 layout
        (``pack``), or back, on the pool's threads; into ``out`` when given (``raw`` itself: in place)."""
        ggml_type, rb = base_type(ggml_type), row_bytes(ggml_type, k)
        if raw.dtype != torch.uint8 or raw.shape[-1] != rb or not raw.is_contiguous() or raw.device.type != "cpu":
            raise ValueError(f"ggml_x8_convert: contiguous host uint8 [..., rows, {rb}], got {raw.dtype} "
                             f"{tuple(raw.shape)}")
        out = torch.empty_like(raw) if out is None else out
        if out.shape != raw.shape or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError("ggml_x8_convert: out must be a contiguous uint8 tensor of raw's shape")
        with self._lock:
            rc = self._lib.moed_cpu_ggml_x8_convert(self._pool, int(ggml_type), int(pack), raw.data_ptr(),
                                                    raw.numel() // rb, k, out.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_cpu_ggml_x8_convert refused its arguments (rc {rc}): rows must be a "
                             f"multiple of 8 of a type with an x8 layout")
        return out

    def ggml_dot8_one(self, x8_type: int, isa: str, group: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor,
                      xsum: torch.Tensor) -> torch.Tensor:
        """One group of eight x8 rows (``uint8 [8, row_bytes]``) dotted with int8 activations ``xq [T, K]`` by
        the kernel of one ISA -> float32 ``[T, 8]`` (tests)."""
        t, k = xq.shape
        if group.dtype != torch.uint8 or group.numel() != 8 * row_bytes(x8_type, k) or xq.dtype != torch.int8 \
                or xs.dtype != torch.float32 or xsum.dtype != torch.float32:
            raise ValueError("ggml_dot8_one: uint8 [8, row_bytes] of an x8 type, int8 xq and float32 xs / xsum")
        y = torch.empty(t, 8, dtype=torch.float32)
        args = [c.contiguous() for c in (group, xq, xs, xsum)]
        rc = self._lib.moed_ggml_dot8_one(x8_type, ISA_NAMES.index(isa), args[0].data_ptr(), k,
                                          *(a.data_ptr() for a in args[1:]), t, y.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_ggml_dot8_one refused its arguments (rc {rc})")
        return y

    def ggml_to_bf16(self, raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        """Rows of GGUF blocks ``uint8 [rows, row_bytes]`` decoded to bf16 ``[rows, k]`` on the pool's
        threads: ``dequantize_rows(raw, ggml_type, k)`` rounded to bf16 (for prefill GEMMs); an x8 matrix
        is unpacked to its rows first."""
        return self._ggml_decode(raw, ggml_type, k, torch.bfloat16)

    def ggml_to_f32(self, raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        """``ggml_to_bf16`` in float32: bit for bit ``dequantize_rows(raw, ggml_type, k)`` (the prefill GEMMs of
        CPUs without native bf16 GEMMs)."""
        return self._ggml_decode(raw, ggml_type, k, torch.float32)

    def _ggml_decode(self, raw: torch.Tensor, ggml_type: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        what = "ggml_to_f32" if dtype == torch.float32 else "ggml_to_bf16"
        if is_x8(ggml_type):
            raw, ggml_type = self.ggml_x8_convert(raw.contiguous(), ggml_type, k, pack=False), base_type(ggml_type)
        rows = check_rows(raw, ggml_type, k, what)
        if not raw.is_contiguous() or raw.device.type != "cpu":
            raise ValueError(f"{what}: the rows must be a contiguous host tensor")
        m = _GgmlMatrix(raw.data_ptr(), ggml_type, rows, k, raw.shape[1])
        out = torch.empty(rows, k, dtype=dtype)
        fn = self._lib.moed_cpu_ggml_to_f32 if dtype == torch.float32 else self._lib.moed_cpu_ggml_to_bf16
        with self._lock:
            rc = fn(self._pool, ctypes.byref(m), out.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_cpu_{what} refused its arguments (rc {rc})")
        return out

    def read_pass(self, buf: torch.Tensor) -> tuple[float, int]:
        """One read of the contiguous host tensor ``buf`` on the pool's threads (read_bw.c): ``(seconds, sum)``,
        the sum (mod 2^64) of its little-endian 8-byte words and then of the bytes past the last whole word."""
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("read_pass: a contiguous host tensor")
        with self._lock:
            t0 = time.perf_counter()
            total = self._lib.moed_cpu_read_pass(self._pool, buf.data_ptr(), buf.numel() * buf.element_size())
            return time.perf_counter() - t0, int(total)

    def moe_ggml_calls(self, bank, moe_layer: int, x: torch.Tensor, ids: list[torch.Tensor],
                       weights: torch.Tensor) -> float:
        """Seconds for ``moe_ggml`` calls one after another, one per ``ids [N, A]`` of the list, with nothing
        between them but the call (as the decode chain runs a step's layers): ``moed bench kernels``'s expert
        passes. Each call's Python around the library (~60-200 us, its cache misses included) would otherwise
        be timed with the kernel."""
        y = torch.empty(x.shape[0], bank.hidden_size)
        args = []
        for i in ids:
            x_, i_, w_, _ = _moe_args(x, i, weights, None, True, bank.hidden_size, bank.num_experts, "expert ids")
            args.append((x_, i_, w_))
        layer = ggml_layer(bank, moe_layer)
        return self._timed_calls("moed_cpu_ggml_moe", ctypes.byref(layer), args, y)

    def moe_calls(self, desc: "BankDescriptor", x: torch.Tensor, ids: list[torch.Tensor], weights: torch.Tensor) -> float:
        """``moe_ggml_calls`` for a converted bank (``moe``)."""
        bank = desc.struct
        y = torch.empty(x.shape[0], bank.D)
        args = [_moe_args(x, i, weights, None, True, bank.D, bank.num_slots, "flat ids")[:3] for i in ids]
        return self._timed_calls("moed_cpu_moe", ctypes.byref(bank), args, y)

    def _timed_calls(self, name: str, layer, args: list, y: torch.Tensor) -> float:
        """Seconds for the library's MoE call ``name`` on each checked ``(x, ids, weights)`` of ``args``, back to
        back under the lock, outputs merged into ``y``."""
        calls = [(self._pool, layer, x_.data_ptr(), i_.shape[0], i_.shape[1], i_.data_ptr(), w_.data_ptr(), None,
                  y.data_ptr()) for x_, i_, w_ in args]
        fn = getattr(self._lib, name)
        with self._lock:
            t0 = time.perf_counter()
            for c in calls:
                if fn(*c) != 0:
                    raise ValueError(f"{name} refused its arguments")
            return time.perf_counter() - t0

    def quantize_act_span(self, x: torch.Tensor, span: int, isa: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` float32 ``[T, K]`` -> int8 activations ``(xq [T, K], xs [T, K/32], xsum [T, K/32])`` with one
        scale per ``span`` values, by the code of one ISA (tests: native_cpu_reference.quantize_activations is
        the twin)."""
        t, k = x.shape
        if x.dtype != torch.float32 or span not in (32, 256) or k % span:
            raise ValueError(f"quantize_act_span: float32 [T, K] with K a multiple of the span (32 or 256), "
                             f"got {x.dtype} {tuple(x.shape)} and span {span}")
        x = x.contiguous()
        xq = torch.empty(t, k, dtype=torch.int8)
        xs, xsum = torch.empty(t, k // 32), torch.empty(t, k // 32)
        self._lib.moed_quantize_act_span_isa(ISA_NAMES.index(isa), x.data_ptr(), t, k, span, xq.data_ptr(),
                                             xs.data_ptr(), xsum.data_ptr())
        return xq, xs, xsum

    def activate_row(self, kind: int, g: torch.Tensor, u: torch.Tensor, isa: str, *, sg: float = 1.0, su: float = 1.0,
                     bg: torch.Tensor | None = None, bu: torch.Tensor | None = None, alpha: float = 1.0,
                     limit: float = 7.0) -> torch.Tensor:
        """The experts' activation of one row, ``act(g * sg + bg, u * su + bu)`` (``ExpertActivation``'s kinds),
        by the code of one ISA (tests: the scalar code, libm's expf and tanhf, is the twin)."""
        vecs = [v for v in (g, u, bg, bu) if v is not None]
        if any(v.dtype != torch.float32 or v.dim() != 1 or v.numel() != g.numel() for v in vecs):
            raise ValueError("activate_row: float32 vectors of one length")
        g, u = g.contiguous(), u.contiguous()
        bg, bu = (None if v is None else v.contiguous() for v in (bg, bu))
        h = torch.empty_like(g)
        self._lib.moed_activate_row_isa(ISA_NAMES.index(isa), int(kind), g.data_ptr(), u.data_ptr(), g.numel(), sg, su,
                                        None if bg is None else bg.data_ptr(), None if bu is None else bu.data_ptr(),
                                        alpha, limit, h.data_ptr())
        return h

    def ggml_act_span(self, ggml_type: int) -> int:
        """Values per activation scale the kernels of ``ggml_type`` take (ggml_rows_format.act_span)."""
        return int(self._lib.moed_ggml_act_span(int(ggml_type)))

    def ggml_dot_one(self, ggml_type: int, isa: str, row: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor,
                     xsum: torch.Tensor) -> torch.Tensor:
        """One row of GGUF blocks (``uint8 [row_bytes]``) dotted with int8 activations ``xq [T, K]``
        (``xs``/``xsum`` float32 ``[T, K/32]``) by the kernel of one ISA -> float32 ``[T]`` (tests)."""
        t, k = xq.shape
        if row.dtype != torch.uint8 or row.numel() != row_bytes(ggml_type, k) or xq.dtype != torch.int8 \
                or xs.dtype != torch.float32 or xsum.dtype != torch.float32:
            raise ValueError("ggml_dot_one: a uint8 row of the type's bytes, int8 xq and float32 xs / xsum")
        y = torch.empty(t, dtype=torch.float32)
        args = [c.contiguous() for c in (row, xq, xs, xsum)]
        rc = self._lib.moed_ggml_dot_one(ggml_type, GGML_ISA_NAMES.index(isa), *(a.data_ptr() for a in args[:1]), k,
                                         *(a.data_ptr() for a in args[1:]), t, y.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_ggml_dot_one refused its arguments (rc {rc})")
        return y

    def ggml_fdot_one(self, ggml_type: int, isa: str, row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One row of an FP8 block type (``uint8 [row_bytes]``) dotted with float activations ``x [T, K]`` by the
        kernel of one ISA -> float32 ``[T]`` (tests; ggml_rows_fp8.c)."""
        t, k = x.shape
        if row.dtype != torch.uint8 or row.numel() != row_bytes(ggml_type, k) or x.dtype != torch.float32:
            raise ValueError("ggml_fdot_one: a uint8 row of the type's bytes and float32 x")
        y = torch.empty(t, dtype=torch.float32)
        row, x = row.contiguous(), x.contiguous()
        rc = self._lib.moed_ggml_fdot_one(ggml_type, ISA_NAMES.index(isa), row.data_ptr(), k, x.data_ptr(), t,
                                          y.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_ggml_fdot_one refused its arguments (rc {rc})")
        return y

    def rows_to_bf16(self, dtype: str, arrays: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
        """One rows-layout matrix dequantised to bf16 ``[N, K]`` (for prefill GEMMs): bit for bit
        ``rows_format.dequantize_rows(dtype, arrays, torch.bfloat16)``, on the pool's threads."""
        return self._rows_decode(dtype, arrays, k, torch.bfloat16)

    def rows_to_f32(self, dtype: str, arrays: tuple[torch.Tensor, ...], k: int) -> torch.Tensor:
        """``rows_to_bf16`` in float32: bit for bit ``rows_format.dequantize_rows(dtype, arrays, torch.float32)``."""
        return self._rows_decode(dtype, arrays, k, torch.float32)

    def _rows_decode(self, dtype: str, arrays: tuple[torch.Tensor, ...], k: int, out_dtype: torch.dtype) -> torch.Tensor:
        what = "rows_to_f32" if out_dtype == torch.float32 else "rows_to_bf16"
        if dtype not in ROWS_CODES:
            raise ValueError(f"{what}: dtype must be q8, int4 or fp8, got {dtype!r}")
        n = arrays[0].shape[0]
        shapes = rows_shapes(dtype, k, n)
        if len(arrays) != len(shapes) or any(tuple(t.shape) != shape or t.dtype != tdtype or not t.is_contiguous()
                                             or t.device.type != "cpu" for t, (shape, tdtype) in zip(arrays, shapes)):
            raise ValueError(f"{what}: a {dtype} [{n}, {k}] matrix must be contiguous host arrays")
        m = _Matrix(arrays[0].data_ptr(), arrays[1].data_ptr(), arrays[2].data_ptr() if len(arrays) > 2 else None, k, n)
        out = torch.empty(n, k, dtype=out_dtype)
        fn = self._lib.moed_cpu_rows_to_f32 if out_dtype == torch.float32 else self._lib.moed_cpu_rows_to_bf16
        with self._lock:
            rc = fn(self._pool, ROWS_CODES[dtype], ctypes.byref(m), out.data_ptr())
        if rc != 0:
            raise ValueError(f"moed_cpu_{what} refused its arguments (rc {rc})")
        return out

    # ------------------------------------------------------------------ MoE
    def moe(self, bank: BankDescriptor, x: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor | None,
            *, per_slot: torch.Tensor | None = None, merge: bool = True) -> torch.Tensor | None:
        """The routed experts of ``x [N, D]``: ``flat_ids [N, A]`` (-1 = slot not run here). Returns the
        weighted sum ``[N, D]`` over the slots run (ascending slot order) when ``merge``; fills
        ``per_slot [N, A, D]`` for the slots run when given."""
        x, ids, w, y = _moe_args(x, flat_ids, weights, per_slot, merge, bank.hidden, bank.num_slots, "flat ids")
        n, a = ids.shape
        if n == 0:
            return y
        with self._lock:
            rc = self._lib.moed_cpu_moe(self._pool, ctypes.byref(bank.struct), x.data_ptr(), n, a, ids.data_ptr(),
                                        _ptr(w), _ptr(per_slot), _ptr(y))
        if rc != 0:
            raise MemoryError("the native MoE kernel ran out of memory") if rc == -2 else \
                _ids_error(ids, bank.num_slots, "flat ids", rc)
        return y

    def moe_ggml(self, bank, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None, *,
                 per_slot: torch.Tensor | None = None, merge: bool = True) -> torch.Tensor | None:
        """``moe`` for one MoE layer of a ggml bank: ``ids [N, A]`` are the layer's expert numbers
        (-1 = slot not run here)."""
        x, ids, w, y = _moe_args(x, ids, weights, per_slot, merge, bank.hidden_size, bank.num_experts, "expert ids")
        n, a = ids.shape
        if n == 0:
            return y
        layer = ggml_layer(bank, moe_layer)
        with self._lock:
            rc = self._lib.moed_cpu_ggml_moe(self._pool, ctypes.byref(layer), x.data_ptr(), n, a, ids.data_ptr(),
                                             _ptr(w), _ptr(per_slot), _ptr(y))
        if rc != 0:
            raise MemoryError("the native ggml MoE kernel ran out of memory") if rc == -2 else \
                _ids_error(ids, bank.num_experts, "expert ids", rc)
        return y

    # ------------------------------------------------------------------ a decode step's layers
    def chain_work_floats(self, layers: "ctypes.Array[ChainLayer]", rows: int, hidden: int) -> int:
        """Floats of work memory ``decode_layers`` needs for ``rows`` rows."""
        return int(self._lib.moed_chain_work_floats(layers, len(layers), rows, hidden))

    def decode_layers(self, layers: "ctypes.Array[ChainLayer]", x: torch.Tensor, *, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, ints: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor,
                      num_keys: int, work: torch.Tensor,
                      ids_out: torch.Tensor, experts_out: torch.Tensor, head: "ChainHead | None" = None,
                      timings: torch.Tensor | None = None) -> None:
        """Every layer of one decode step on ``x [B, D]`` float32, in place (native/cpu/decode_chain.c):
        ``ints [2, B]`` int64 (starts, positions), ``block_tables [B, max_blocks]`` int32 (each row's
        pool blocks, see attn_decode.h), ``lengths [B]`` int32, ``cos``/``sin [B, R/2]``
        float32; ``ids_out [layers, B, A]`` int32 and ``experts_out [layers]`` int32 are filled; with
        ``head`` the final norm and lm_head write its ``logits [B, V]``; ``timings [6]`` float64
        (``CHAIN_PARTS``) accumulates seconds when given. The caller (the
        model's DecodeChain) has checked shapes and dtypes; the C side checks the layer descriptions."""
        rows, d = x.shape
        if block_tables.dtype != torch.int32 or block_tables.shape[0] != rows or not block_tables.is_contiguous():
            raise ValueError(f"decode_layers: block_tables must be contiguous int32 [{rows}, max_blocks]")
        step = _ChainStep(rows, d, eps, cos.data_ptr(), sin.data_ptr(), block_tables.data_ptr(),
                          block_tables.shape[1], ints[0].data_ptr(), ints[1].data_ptr(), lengths.data_ptr(), num_keys)
        with self._lock:
            rc = self._lib.moed_cpu_decode_layers(self._pool, layers, len(layers), ctypes.byref(step), x.data_ptr(),
                                                  None if head is None else ctypes.byref(head), work.data_ptr(),
                                                  work.numel(), ids_out.data_ptr(), experts_out.data_ptr(),
                                                  _ptr(timings))
        if rc != 0:
            if rc == -2:
                raise MemoryError("the native decode step ran out of memory")
            where = f" (layer {-3 - rc}'s description is inconsistent)" if rc <= -3 else ""
            raise ValueError(f"moed_cpu_decode_layers refused its arguments (rc {rc}){where}")

    # ------------------------------------------------------------------ one strip (tests)
    def strip(self, dtype: str, isa: str, arrays: tuple[torch.Tensor, ...], k: int, n: int, x: torch.Tensor,
              j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One strip of one matrix (``arrays``: the per-expert tensors of moed_cpu.h's layout) with the ISA
        ``isa``; returns ``(lo [T, j1-j0], hi [T, j1-j0])``."""
        x = _f32_rows(x, "x")
        arrays = tuple(t.contiguous() for t in arrays)
        m = _Matrix(arrays[0].data_ptr(), _ptr(arrays[1]) if len(arrays) > 1 else None,
                    _ptr(arrays[2]) if len(arrays) > 2 else None, k, n)
        t = x.shape[0]
        lo = torch.full((t, j1 - j0), float("nan"))
        hi = torch.full((t, j1 - j0), float("nan"))
        rc = self._lib.moed_cpu_strip(DTYPE_CODES[dtype], ISA_NAMES.index(isa), ctypes.byref(m), x.data_ptr(), t,
                                      j0, j1, lo.data_ptr(), hi.data_ptr(), j1 - j0)
        if rc != 0:
            raise ValueError(f"moed_cpu_strip refused its arguments (rc {rc})")
        return lo, hi


def bank_descriptor(bank) -> BankDescriptor:
    """The library's view of an ExpertBank (checked: dtypes, shapes, contiguity)."""
    from moed.kernels.expert_matmul import _packed_tensors, check_matrix

    fmt, n_gu, k_gu, c_gu = check_matrix(bank.tensors, "gate_up")
    fmt_dn, n_dn, k_dn, c_dn = check_matrix(bank.tensors, "down")
    d, inter = bank.hidden_size, bank.intermediate_size
    if fmt != fmt_dn or (n_gu, k_gu, c_gu) != (bank.num_slots, d, 2 * inter) or (n_dn, k_dn, c_dn) != (bank.num_slots, inter, d):
        raise ValueError(f"bank matrices do not match its sizes: gate_up {fmt} {n_gu}x{k_gu}x{c_gu}, "
                         f"down {fmt_dn} {n_dn}x{k_dn}x{c_dn}")
    if fmt in ("fp32", "bf16"):
        gu, dn = [bank.tensors["gate_up"]], [bank.tensors["down"]]
    else:
        gu, dn = _packed_tensors(bank.tensors, fmt, "gate_up"), _packed_tensors(bank.tensors, fmt, "down")
    for t in (*gu, *dn):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("bank tensors must be contiguous and in host memory")
    gu_b, dn_b = bank.tensors.get("gate_up_bias"), bank.tensors.get("down_bias")
    for t, width in ((gu_b, 2 * inter), (dn_b, d)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (bank.num_slots, width) or not t.is_contiguous()):
            raise ValueError(f"bank bias must be contiguous float32 [{bank.num_slots}, {width}]")
    act = bank.activation
    limit = act.limit if act.limit < 3.0e38 else 3.0e38

    def stride(t: torch.Tensor) -> int:
        return t.stride(0) * t.element_size()

    s = _Bank(DTYPE_CODES[fmt], ACT_CODES[act.kind], float(act.alpha), float(limit), d, inter, bank.num_slots,
              gu[0].data_ptr(), _ptr(gu[1]) if len(gu) > 1 else None, _ptr(gu[2]) if len(gu) > 2 else None,
              dn[0].data_ptr(), _ptr(dn[1]) if len(dn) > 1 else None, _ptr(dn[2]) if len(dn) > 2 else None,
              stride(gu[0]), stride(gu[1]) if len(gu) > 1 else 0, stride(dn[0]), stride(dn[1]) if len(dn) > 1 else 0,
              _ptr(gu_b), _ptr(dn_b))
    keep = tuple(t for t in (*gu, *dn, gu_b, dn_b) if t is not None)
    return BankDescriptor(s, keep, fmt, d, inter, bank.num_slots)


_descriptors: dict[int, tuple[weakref.ref, dict[str, torch.Tensor], BankDescriptor]] = {}


def descriptor_of(bank) -> BankDescriptor:
    """``bank_descriptor(bank)``, cached per bank and rebuilt when its tensors change (a resize, a reload)."""
    key = id(bank)
    entry = _descriptors.get(key)
    if entry is not None:
        ref, sources, desc = entry
        if ref() is bank and len(sources) == len(bank.tensors) and all(
                bank.tensors.get(k) is t for k, t in sources.items()):
            return desc
    desc = bank_descriptor(bank)
    if entry is None:
        weakref.finalize(bank, _descriptors.pop, key, None)
    _descriptors[key] = (weakref.ref(bank), dict(bank.tensors), desc)
    return desc


_native: NativeCpu | None = None
_native_error: str | None = None
_loaded = False
_load_lock = threading.Lock()


_torch_only = threading.local()  # .depth > 0 on a thread inside torch_paths()


@contextlib.contextmanager
def torch_paths():
    """On this thread, ``native()`` is None: the layers take their torch code, as they do on CUDA
    tensors. The device-resident model runs inside it, so the emulated device runs CUDA's lines."""
    _torch_only.depth = getattr(_torch_only, "depth", 0) + 1
    try:
        yield
    finally:
        _torch_only.depth -= 1


def native() -> NativeCpu | None:
    """The process's native kernels, loaded on first use; None when absent or disabled (or inside
    ``torch_paths`` on this thread)."""
    global _native, _native_error, _loaded
    if getattr(_torch_only, "depth", 0):
        return None
    if _loaded:
        return _native
    with _load_lock:
        if not _loaded:
            if os.environ.get("MOED_NATIVE", "1").strip().lower() in ("0", "off", "no", "false"):
                _native_error = "disabled by MOED_NATIVE=0"
            else:
                path = library_path()
                if path is None:
                    _native_error = "not built (no C compiler at install time?); reinstall with gcc present"
                else:
                    try:
                        _native = NativeCpu(path, isa=os.environ.get("MOED_NATIVE_ISA"))
                    except (OSError, RuntimeError, ValueError) as exc:
                        _native_error = str(exc)
            _loaded = True
    return _native


def native_status() -> str:
    """One line for `moed bench kernels` and status: which CPU backend runs the experts."""
    lib = native()
    if lib is None:
        return f"numba (native kernels unavailable: {_native_error})"
    width = ", 512-bit instructions split in two: 256-bit GGUF kernels" \
        if lib.isa.startswith("avx512") and lib.vector_bits == 256 else ""
    return f"{lib.backend} ({lib.num_threads} threads, CPU supports {lib.detected_isa}{width}; {lib.path.name})"
