"""DecodeChain: every layer of a CPU decode step in one native call (native/cpu/decode_chain.c).

At decode the Python path of ``MoeTransformer.forward`` already spends most of a step inside
native kernels (about 7 calls per layer: norm, q/k/v, attention, o_proj, norm, router, experts),
but the Python and torch glue between those calls costs 0.25-0.4 ms per layer on a 2-core
machine: 10-20% of a step. The chain describes each layer's weights once (ctypes structs that
point into the model's tensors) and the C side runs the same entry points in the same order on
the same numbers, so the hidden state it returns is bit for bit the Python path's (tested).

It applies when every expert runs on the CPU from the host bank (the CPU executor: GPU-free mode)
and the model's layers are standard attention + routed MoE (softmax / top-k-softmax router, float32
or bf16) or dense MLPs, with bf16 or packed projections (q8, int4, fp8, GGUF types): Qwen3-MoE, Mixtral, gpt-oss
(biases, sinks, sliding windows), Qwen2-MoE (gated shared experts, dense layers). Anything else
(MLA, whole-projection q/k norms, clipping, float32 or fp16 projections, a float32 shared-expert
gate, sigmoid routers, the hybrid executor) keeps the Python path; ``DecodeChain.build`` says why
in ``reason``. ``MOED_DECODE_CHAIN=0`` turns it off (A/B measurements, debugging).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from moed.cache.expert_dtypes import GGML_BANK
from moed.cache.kv_cache import KVCache
from moed.kernels.native_cpu import (CHAIN_PARTS, KV_TYPE_CODES, MAX_TOKENS, ChainHead, ChainLayer, NativeCpu,
                                     descriptor_of, ggml_layer, linear_struct, native)
from moed.layers.attention import MhaAttention
from moed.layers.dense_mlp import DenseMlp
from moed.layers.moe import MoeLayer
from moed.layers.packed_linear import PackedLinear

ROUTER_KINDS = {"softmax": 0, "topk_softmax": 1}


def chain_enabled() -> bool:
    return os.environ.get("MOED_DECODE_CHAIN", "1").strip().lower() not in ("0", "off", "no", "false")


@dataclass(frozen=True)
class Unsupported:
    """Why a model keeps the Python decode path."""

    reason: str


def _norm_ok(w: torch.Tensor, d: int) -> bool:
    return isinstance(w, torch.Tensor) and w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu" \
        and w.is_contiguous() and tuple(w.shape) == (d,)


def _linear_ok(w, k: int) -> bool:
    if isinstance(w, PackedLinear):  # q8 / int4 / fp8 rows or GGUF block rows, each its own native kernel
        return w.device.type == "cpu" and w.in_features == k
    return isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous() \
        and w.device.type == "cpu" and w.shape[1] == k


def _set_router(s: ChainLayer, mlp: MoeLayer, moe_cfg, d: int, keep: list) -> str:
    """Fill the router fields of ``s`` from ``mlp``; returns what is wrong with it, or ""."""
    router, rbias = mlp.router, mlp.router_bias
    if not (isinstance(router, torch.Tensor) and router.dtype in (torch.float32, torch.bfloat16)
            and router.is_contiguous() and router.device.type == "cpu"
            and tuple(router.shape) == (moe_cfg.num_experts, d)
            and (rbias is None or (rbias.dtype == torch.float32 and rbias.is_contiguous())
                 or router.dtype == torch.bfloat16)):
        return "router is not float32 or bf16 in host memory"
    if rbias is not None and router.dtype == torch.bfloat16:  # added as float32 after the GEMV
        rbias = rbias.detach().float().contiguous()
        keep.append(rbias)
    s.router_w, s.router_b = router.data_ptr(), None if rbias is None else rbias.data_ptr()
    s.router_bf16 = int(router.dtype == torch.bfloat16)
    s.E, s.router_kind = moe_cfg.num_experts, ROUTER_KINDS[moe_cfg.scoring]
    s.renormalise = int(moe_cfg.scoring == "softmax" and bool(moe_cfg.norm_topk_prob))
    return ""


class DecodeChain:
    """The layers of one MoeTransformer as the native decode chain sees them."""

    def __init__(self, lib: NativeCpu, layers: "ctypes.Array[ChainLayer]", keep: list, bank, executor,
                 attentions: list[MhaAttention], hidden: int, top_k: int, eps: float) -> None:
        self.lib, self.layers, self._keep, self.bank, self.executor = lib, layers, keep, bank, executor
        self.attentions = attentions
        self.hidden, self.top_k, self.eps = hidden, top_k, eps
        self.work = torch.empty(lib.chain_work_floats(layers, MAX_TOKENS, hidden), dtype=torch.float32)
        self._ids = torch.empty(len(layers) * MAX_TOKENS * top_k, dtype=torch.int32)
        self.last_ids: torch.Tensor | None = None  # [layers, B, A] expert ids (within each layer) of the last step
        self.experts = torch.empty(len(layers), dtype=torch.int32)
        self.timings: torch.Tensor | None = None  # float64 [len(CHAIN_PARTS)] when a profiler asks for it
        self._bank_desc = None
        self._cache_ref: KVCache | None = None
        self._cache_generation = -1
        self.head: ChainHead | None = None  # the final norm and lm_head, when their weights suit the chain
        self.vocab = 0

    @classmethod
    def build(cls, model) -> "DecodeChain | Unsupported":
        """The chain of ``model`` (a MoeTransformer), or why it keeps the Python path."""
        lib = native()
        if lib is None:
            return Unsupported("no native kernels")
        if not chain_enabled():
            return Unsupported("MOED_DECODE_CHAIN=0")
        config, executor = model.config, model.executor
        bank_of = getattr(executor, "whole_cpu_bank", None)
        bank = bank_of() if bank_of is not None else None
        if bank is None:
            return Unsupported(f"the {type(executor).__name__} does not run every expert on the CPU")
        if config.attention.kind != "mha":
            return Unsupported(f"{config.attention.kind} attention")
        if config.layer_recipe != "pre_norm" or config.full_attention is not None or config.scale_embedding \
                or config.final_logit_softcapping:
            return Unsupported("Gemma-4's layers (sandwich norms, two attention shapes, scaled embedding, soft-capped "
                               "logits)")
        if config.mlp_activation != "silu" or config.moe.activation in ("relu2", "gelu_tanh"):
            return Unsupported(f"{config.mlp_activation} / {config.moe.activation} MLPs (the chain's are SwiGLU)")
        if config.has_recurrent_state or config.attention.gated:
            return Unsupported("gated / linear attention (a hybrid model)")
        att = config.attention
        if att.qk_norm == "weightless" or att.nope_temperature or any(config.attention_chunks) \
                or not all(map(config.uses_rope, range(config.num_layers))):
            return Unsupported("Llama-4's attention (weightless q/k norm, chunked local attention, layers without "
                               "rotary)")
        if att.qk_norm not in ("none", "per_head") or att.clip_qkv is not None:
            return Unsupported("q/k norm over the whole projection or q/k/v clipping")
        d = config.hidden_size
        moe_cfg = config.moe
        if moe_cfg.scoring not in ROUTER_KINDS or moe_cfg.weight_input:
            return Unsupported(f"{moe_cfg.scoring} router" + (" weighing the expert's input" if moe_cfg.weight_input else ""))
        structs, keep, attentions = [], [bank], []
        for i, (input_norm, attention, post_norm, mlp) in enumerate(model.layers):
            if isinstance(mlp, MoeLayer) and mlp.executor is not executor:
                return Unsupported(f"layer {i}'s MoE runs on another executor")
            dense = mlp if isinstance(mlp, DenseMlp) else getattr(mlp, "shared", None)
            if not isinstance(mlp, (MoeLayer, DenseMlp)):
                return Unsupported(f"layer {i}'s MLP ({type(mlp).__name__})")
            if dense is not None:
                inter = dense.gate.shape[0]
                if not (_linear_ok(dense.gate, d) and _linear_ok(dense.up, d) and _linear_ok(dense.down, inter)):
                    return Unsupported(f"layer {i}'s dense MLP / shared expert is not bf16 or packed")
                gate = getattr(mlp, "shared_gate", None)
                if gate is not None and not _linear_ok(gate, d):
                    return Unsupported(f"layer {i}'s shared expert gate is not bf16 or packed")
            if not isinstance(attention, MhaAttention):
                return Unsupported(f"layer {i}'s attention")
            if not (_norm_ok(input_norm, d) and _norm_ok(post_norm, d)):
                return Unsupported(f"layer {i}'s norms are not float32/bf16 [{d}] in host memory")
            a_out = att.num_heads * att.head_dim
            if not all(_linear_ok(w, d) for w in (attention.wq, attention.wk, attention.wv)) \
                    or not _linear_ok(attention.wo, a_out):
                return Unsupported(f"layer {i}'s projections are not bf16 or packed in host memory")
            s = ChainLayer()
            if dense is not None:
                mlp_lin = [linear_struct(w, None) for w in (dense.gate, dense.up, dense.down)]
                gate = getattr(mlp, "shared_gate", None)
                if gate is not None:
                    mlp_lin.append(linear_struct(gate, None))
                for _, tensors in mlp_lin:
                    keep.extend(tensors)
                s.mlp_gate, s.mlp_up, s.mlp_down = (struct for struct, _ in mlp_lin[:3])
                if gate is not None:
                    s.mlp_scale = mlp_lin[3][0]
            s.top_k = moe_cfg.top_k  # the ids layout [layers, B, A]; a dense layer's are -1
            if isinstance(mlp, MoeLayer):
                problem = _set_router(s, mlp, moe_cfg, d, keep)
                if problem:
                    return Unsupported(f"layer {i}'s {problem}")
                if bank.dtype == GGML_BANK:  # the layer's own block rows, addressed by expert number
                    layer_desc = ggml_layer(bank, mlp.moe_layer)
                    keep.append(layer_desc)
                    s.ggml = ctypes.addressof(layer_desc)
                else:
                    s.flat_base = bank.flat_id(mlp.moe_layer, 0)
            lin = [linear_struct(w, b) for w, b in ((attention.wq, attention.bq), (attention.wk, attention.bk),
                                                    (attention.wv, attention.bv), (attention.wo, attention.bo))]
            for _, tensors in lin:
                keep.extend(tensors)
            q_norm, k_norm, sinks = attention.native_f32()
            keep.extend(t for t in (q_norm, k_norm, sinks) if t is not None)
            s.in_norm, s.in_norm_bf16 = input_norm.data_ptr(), int(input_norm.dtype == torch.bfloat16)
            s.post_norm, s.post_norm_bf16 = post_norm.data_ptr(), int(post_norm.dtype == torch.bfloat16)
            s.q, s.k, s.v, s.o = (struct for struct, _ in lin)
            a = s.attn
            a.H, a.Hk, a.Dh, a.Dv = att.num_heads, att.num_kv_heads, att.head_dim, att.head_dim
            a.q_norm = None if q_norm is None else q_norm.data_ptr()
            a.k_norm = None if k_norm is None else k_norm.data_ptr()
            a.eps, a.rot_dim, a.interleaved = attention.eps, model.rotary.dim, int(model.rotary.interleaved)
            a.window, a.scale = attention.window or 0, att.scaling
            a.sinks = None if sinks is None else sinks.data_ptr()
            structs.append(s)
            attentions.append(attention)
        layers = (ChainLayer * len(structs))(*structs)
        chain = cls(lib, layers, keep, bank, executor, attentions, d, moe_cfg.top_k, config.rms_norm_eps)
        if _norm_ok(model.final_norm, d) and _linear_ok(model.lm_head, d):  # else the model runs them itself
            lm_head, tensors = linear_struct(model.lm_head, None)
            keep.extend((model.final_norm, *tensors))
            chain.head = ChainHead(model.final_norm.data_ptr(), int(model.final_norm.dtype == torch.bfloat16), lm_head,
                                   None)
            chain.vocab = lm_head.m.N
        return chain

    def applies(self, x: torch.Tensor, cache: KVCache) -> bool:
        """Whether this step (``x [B, 1, D]``, every row one real token) can run here."""
        return native() is self.lib and x.device.type == "cpu" and x.dtype == torch.float32 \
            and 0 < x.shape[0] <= MAX_TOKENS and x.shape[1] == 1 \
            and cache.entry(0, "k").dtype in KV_TYPE_CODES and cache.entry(0, "k").device.type == "cpu"

    def _bind(self, cache: KVCache) -> None:
        """Point the layer structs at this step's KV cache and the bank's current arrays."""
        desc = None if self.bank.dtype == GGML_BANK else descriptor_of(self.bank)  # cached; new after a resize
        if desc is not None and desc is not self._bank_desc:
            pointer = ctypes.pointer(desc.struct)
            for s in self.layers:
                if s.router_w:  # MoE layers; a dense layer's bank stays NULL
                    s.bank = pointer
            self._bank_desc = desc
        if cache is not self._cache_ref or cache.generation != self._cache_generation:  # a new or resized pool
            for s, attention in zip(self.layers, self.attentions):
                k, v = cache.entry(attention.layer, "k"), cache.entry(attention.layer, "v")
                s.attn.k_cache, s.attn.v_cache = k.data_ptr(), v.data_ptr()
                s.attn.block_size, s.attn.num_blocks = k.shape[1], k.shape[0]
                s.attn.kv_type = KV_TYPE_CODES[k.dtype]
                ks, vs = cache.entry_scale(attention.layer, "k"), cache.entry_scale(attention.layer, "v")
                s.attn.k_scale = ks.data_ptr() if ks is not None else None
                s.attn.v_scale = vs.data_ptr() if vs is not None else None
            self._cache_ref, self._cache_generation = cache, cache.generation

    def run(self, x: torch.Tensor, batch, cache: KVCache, cos_sin: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [B, 1, D]`` after the embedding -> (the hidden state before the final norm ``[B, 1, D]``,
        the logits ``[B, V]`` when the chain runs the final norm and lm_head too, else None)."""
        rows = x.shape[0]
        tables = cache.table_tensor(batch)  # checks that every row's table holds its tokens
        self._bind(cache)
        h = x.reshape(rows, self.hidden).contiguous()
        cos, sin = (t[:, 0].float().contiguous() for t in cos_sin)
        ints = torch.tensor([batch.starts, batch.starts], dtype=torch.int64)  # position = start
        lengths = torch.ones(rows, dtype=torch.int32)
        ids = self._ids[: len(self.layers) * rows * self.top_k].view(len(self.layers), rows, self.top_k)
        logits = None
        if self.head is not None:
            logits = torch.empty(rows, self.vocab, dtype=torch.float32)
            self.head.logits = logits.data_ptr()
        self.lib.decode_layers(self.layers, h, eps=self.eps, cos=cos, sin=sin, ints=ints, block_tables=tables,
                               lengths=lengths,
                               num_keys=batch.num_keys, work=self.work, ids_out=ids, experts_out=self.experts,
                               head=self.head, timings=self.timings)
        self.last_ids = ids
        self.executor.count_native(int(self.experts.sum()))
        return h.view(rows, 1, self.hidden), logits

    def enable_timings(self) -> torch.Tensor:
        """Start accumulating seconds per part (``CHAIN_PARTS``) of every later step; returns the tensor."""
        self.timings = torch.zeros(len(CHAIN_PARTS), dtype=torch.float64)
        return self.timings
