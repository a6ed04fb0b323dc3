"""Read a GGUF file (llama.cpp's format) in moed's canonical form, a piece at a time, as HfCheckpoint does a HF directory.

The config is synthesised from the GGUF metadata into the config.json a Hugging Face checkpoint
of the same model has (``raw_config``: what ``parse_model_config`` takes and an FTW conversion
stores), one builder per llama.cpp architecture (weights/gguf_metadata.py, which lists what each
reads). Tensor names are llama.cpp's and map onto moed's canonical names (weights/gguf_names.py,
with the two tensors llama.cpp stores differently: Mixtral's permuted Q/K rows and DeepSeek's
split kv_b_proj).

Non-expert weights are read one at a time. ``read_weight`` dequantises them (F32/F16/BF16 stay as
stored, quantised types become bf16: what ``moed convert`` writes and an explicit weights dtype
loads). ``packed_weight_dtype`` / ``read_packed_weight`` keep the quantised 2-D weights that go
through layers/linear.py (attention projections, the lm_head, shared-expert MLPs) and the token
embedding (looked up a row at a time, as llama.cpp's get_rows reads it) packed as
a PackedLinear instead, which the loader does by default, each in its stored type: Q8_0 -> q8 bit
for bit, every other type the ggml kernels read (Q4_K, Q6_K, IQ4_XS, ...) as its own GGUF block
rows, byte for byte; a type those do not read, or a row length that is not whole blocks of it, is
re-quantised to q8 (and listed by ``type_changes``). Routed experts (``ffn_{gate,up,down}_exps``: numpy ``[E, I, D]``, ``[E, I, D]``,
``[E, D, I]``) are read a chunk of experts at a time with pread and either repacked without
dequantising into the bank layout the stored type matches (Q8_0 -> q8, MXFP4 -> mxfp4,
Q4_0/Q4_1/Q4_K -> int4) or dequantised to float32 k-major rows; one chunk is all that is ever
held, whatever the file's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moed.cache.expert_dtypes import GGML_BANK
from moed.cache.host_bank import ExpertActivation, ExpertBank
from moed.errors import InvalidRequestError, ModelFormatError, UnsupportedModelError, quoted
from moed.kernels.ggml_rows_format import GGUF_ROW_TYPES as ROW_TYPES, row_bytes
from moed.kernels.int4_format import quantize_int4
from moed.kernels.mxfp4_format import quantize_mxfp4
from moed.kernels.q8_format import quantize_q8
from moed.layers.packed_linear import PackedLinear, can_pack, ggml_linear_dtype
from moed.models.families import Family, family_of, parse_model_config
from moed.models.model_config import ModelConfig
from moed.models.weight_spec import expected_weight_shapes
from moed.text.gguf_vocab import gguf_tokenizer_files
from moed.kernels import gguf_quants as q
from moed.weights.expert_chunk import ExpertChunk
from moed.weights.gguf_file import GgufFile, GgufTensor
from moed.weights.gguf_metadata import ARCHITECTURES, read_config
from moed.weights.gguf_names import (GLOBAL_TENSORS, KV_B_PARTS, LAYER_TENSORS, PERMUTED_QK, PLUS_ONE_NORMS,
                                     QKVZ_PARTS, join_kv_b, join_qkvz, layer_of, unpermute_rows, untile_v_heads)
from moed.weights.hf_checkpoint import CHUNK_EXPERTS

NATIVE_DTYPES = {q.F32: torch.float32, q.F16: torch.float16, q.BF16: torch.bfloat16}
# stored expert type -> the bank dtype its blocks repack into without dequantising
REPACKED_BANK = {q.Q8_0: "q8", q.MXFP4: "mxfp4", q.Q4_0: "int4", q.Q4_1: "int4", q.Q4_K: "int4"}
# stored expert type -> the bank dtype that keeps it best (see default_bank_dtype)
# (5-6 bits -> q8: its 255 levels re-quantise them well under their own step; 2-3 bits and the
# non-linear IQ4 levels -> int4, which keeps the file's size class: q8 would double an IQ4_XS model)
DEFAULT_BANK = {q.F32: "fp32", q.F16: "fp32", q.BF16: "bf16", **REPACKED_BANK, q.Q5_K: "q8", q.Q6_K: "q8",
                q.Q5_0: "q8", q.Q5_1: "q8", q.Q2_K: "int4", q.Q3_K: "int4", q.IQ4_NL: "int4", q.IQ4_XS: "int4",
                q.NVFP4: "int4"}
_REPACKERS = {"q8": q.to_q8_bank, "mxfp4": q.to_mxfp4_bank, "int4": q.to_int4_bank}
_QUANTISERS = {"q8": quantize_q8, "mxfp4": quantize_mxfp4, "int4": quantize_int4}
# bank tensor suffixes, in the order the repackers and quantisers return them (cache/host_bank.py)
_PACKED_PARTS = {"q8": ("qs", "d"), "mxfp4": ("fp4", "e8m0"), "int4": ("q", "scale", "min")}
# stored type of a 2-D weight that goes through linear() -> the PackedLinear dtype it loads as: Q8_0 as
# q8 (the same codes and scales), the other types the ggml kernels read as their own rows, anything else
# that gguf decodes (IQ1-IQ3, TQ) re-quantised to q8
PACKED_LINEAR = {q.Q8_0: "q8", **{t: ggml_linear_dtype(t) for t in ROW_TYPES if ggml_linear_dtype(t)}}
# canonical names (after "model.layers.{i}.") of the weights layers/linear.py's linear() multiplies
# with: the router (linear_f32, F32 in GGUF files) and the [1, D] shared-expert gate are not packed
_LINEAR_WEIGHTS = frozenset({
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.shared.gate_proj.weight", "mlp.shared.up_proj.weight", "mlp.shared.down_proj.weight",
})
_REQUANTISE_COLUMNS = 1 << 22  # weights re-quantised per step (Q5_K/Q6_K -> q8): bounds the temporaries
REQUANTISE = "re-quantise the model with llama.cpp's llama-quantize to one moed reads (e.g. Q4_K_M or Q8_0)"

class GgufCheckpoint:
    """One GGUF file: config synthesised, tensor names mapped; data read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file = GgufFile(self.path)
        arch = self.file.architecture
        if arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: GGUF architecture {quoted(arch)} is not supported; moed reads "
                + ", ".join(f"{a} ({spec.what})" for a, spec in ARCHITECTURES.items())
                + " GGUF files (or a Hugging Face directory of a supported family)")
        self.arch, self.spec = arch, ARCHITECTURES[arch]
        self._split_fused_experts()
        self.raw_config = read_config(self.file, arch)
        where = str(self.path)
        self.family: Family = family_of(self.raw_config, where=where)
        self.config: ModelConfig = parse_model_config(self.raw_config, where=where)
        self._shapes = expected_weight_shapes(self.config)
        # each moed layer's blocks when they are not one block a layer (Nemotron-H: mixer, feed-forward)
        self._blocks = self.spec.layer_blocks(self.raw_config) if self.spec.layer_blocks is not None else None
        # weights stored as two tensors (deepseek2's kv_b_proj, qwen3next's in_proj_qkvz): their GGUF names
        self._parts: dict[str, tuple[str, str]] = {}
        self.weight_keys = {name: self._gguf_name(name) for name in self._shapes}  # canonical -> GGUF
        self._experts = {layer: self._expert_tensors(layer) for layer in range(self.config.num_layers)}
        self._check_weights()

    # ---- the interface HfCheckpoint offers the loader and the converter -------------------------

    @property
    def num_bank_rows(self) -> int:
        return self.config.num_moe_layers * self.config.moe.num_experts

    def source_files(self) -> list[Path]:
        """The file, or every part of a split GGUF."""
        return list(self.file.files)

    def tokenizer_files(self) -> dict[str, str]:
        """tokenizer.json, tokenizer_config.json and generation_config.json (contents), rebuilt
        from the file's tokenizer metadata (text/gguf_vocab.py)."""
        return gguf_tokenizer_files(self.file.metadata, where=str(self.path))

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def weight_dtype(self, name: str) -> torch.dtype:
        """``read_weight``'s dtype: F32, F16 and BF16 weights keep their dtype; quantised ones are
        dequantised to bf16 (a load keeps those of ``packed_weight_dtype`` packed instead)."""
        return NATIVE_DTYPES.get(self.file.tensor(self.weight_keys[name]).ggml_type, torch.bfloat16)

    def read_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One non-expert weight in its canonical shape, in ``dtype`` (default: ``weight_dtype(name)``)."""
        if name in self._parts:
            tensor = self._joined(name)
        else:
            info = self.file.tensor(self.weight_keys[name])
            raw = self._raw(name)
            native = NATIVE_DTYPES.get(info.ggml_type)
            tensor = raw.view(native) if native is not None else q.dequantize(raw, info.ggml_type, info.shape)
        tensor = self._as_canonical(name, tensor.reshape(self._shapes[name]))
        return tensor.reshape(self._shapes[name]).to(dtype or self.weight_dtype(name)).contiguous()

    def packed_weight_dtype(self, name: str) -> str | None:
        """The PackedLinear dtype of ``name`` when it is a quantised weight linear() multiplies with: its
        own GGUF type's rows ("q4_k", ...) or q8 (Q8_0; or re-quantised, for a type the kernels do not
        read); None for anything to load as a tensor (floats, and shapes no packed form fits)."""
        rel = name.partition(".layers.")[2].partition(".")[2] if ".layers." in name else None
        embedding = name == "model.embed_tokens.weight"
        if name != "lm_head.weight" and not embedding and rel not in _LINEAR_WEIGHTS or name in self._parts:
            return None
        shape = self._shapes[name]
        stored = self.file.tensor(self.weight_keys[name]).ggml_type
        if len(shape) != 2 or stored in NATIVE_DTYPES:
            return None
        kept = PACKED_LINEAR.get(stored, None if embedding else "q8")  # an embedding is never re-quantised
        if kept is None:
            return None
        if can_pack(shape[1], shape[0], kept):
            return kept
        return "q8" if not embedding and can_pack(shape[1], shape[0]) else None

    def read_packed_weight(self, name: str) -> PackedLinear:
        """One weight ``packed_weight_dtype`` accepts, as a PackedLinear (rows layout), converted as the
        routed experts are (``expert_chunks``)."""
        target = self.packed_weight_dtype(name)
        if target is None:
            raise ValueError(f"weight {quoted(name)} does not load packed; read it with read_weight")
        info = self.file.tensor(self.weight_keys[name])
        n, k = self._shapes[name]
        raw = self._raw(name)
        if PACKED_LINEAR.get(info.ggml_type) == target and target != "q8":  # the stored rows, byte for byte
            return PackedLinear(target, (raw.view(n, -1).contiguous(), torch.ones(1)), k, n)
        if REPACKED_BANK.get(info.ggml_type) == target:  # Q8_0: a 2-D weight is one expert
            arrays = tuple(t[0] for t in _REPACKERS[target](raw, info.ggml_type, (1, n, k)))
            return PackedLinear.from_kn(target, arrays, k, n)
        # a type the kernels do not read, or rows that are not whole blocks of it: dequantised and
        # re-quantised to q8, a slice of rows at a time
        w = q.dequantize(raw, info.ggml_type, (n, k))  # [N, K] float32
        del raw
        qs, d = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // 32, dtype=torch.float16)
        step = max(2, _REQUANTISE_COLUMNS // k)
        for j in range(0, n, step):
            part_qs, part_d = quantize_q8(w[j:j + step].t().contiguous())  # k-major [K, rows]
            qs[j:j + step], d[j:j + step] = part_qs.t(), part_d.t()
        return PackedLinear(target, (qs, d), k, n)

    def default_bank_dtype(self) -> str:
        """The runnable bank dtype that keeps the routed experts' stored precision (or the closest).

        F32/F16 -> fp32 (both exact); BF16 -> bf16; Q8_0 -> q8 and MXFP4 -> mxfp4 (the same blocks,
        bit for bit); Q4_0/Q4_1/Q4_K -> int4 (the 4-bit codes kept, only the per-32 scale and min
        rounded to bf16); Q5_K/Q6_K -> q8: no bank holds 5 or 6 bits, and q8's 255 levels per 32
        weights re-quantise them with an error well under their own step, where int4's 16 levels
        would lose more than the file's quantisation did. The type holding most expert weights
        decides (a Q4_K_M file keeps some ffn_down_exps in Q6_K: those are re-quantised to int4).
        """
        counts: dict[int, int] = {}
        for names in self._experts.values():
            for name in names[:3] if names else ():
                info = self.file.tensor(name)
                counts[info.ggml_type] = counts.get(info.ggml_type, 0) + math.prod(info.shape)
        if not counts:
            return "fp32"
        ranked = sorted(counts, key=lambda t: (counts[t], q.block_size(t)[1] / q.block_size(t)[0]))
        return DEFAULT_BANK.get(ranked[-1], "int4")  # a type only gguf decodes (IQ1-IQ3, TQ): 4 bits

    def type_changes(self, bank_dtype: str | None = None, *, packed: bool = True) -> list[str]:
        """What loading changes about the stored tensors, one line per (stored type, loaded form): routed
        experts that do not repack block for block into ``bank_dtype`` (default: ``default_bank_dtype()``),
        linear() weights re-quantised to q8 (``packed``), other quantised weights decoded to bf16.
        Lossless loads (Q8_0 -> q8, MXFP4 -> mxfp4, floats) and Q4_0/Q4_1/Q4_K -> int4 (the codes kept,
        the scales rounded to bf16, docs/design.md) are not listed."""
        target = bank_dtype or self.default_bank_dtype()
        groups: dict[tuple[int, str], list[str]] = {}
        exact = {q.F32: ("fp32",), q.F16: ("fp32",), q.BF16: ("bf16", "fp32")}
        for names in self._experts.values():
            for name in (names or ())[:3]:
                stored = self.file.tensor(name).ggml_type
                if target != GGML_BANK and REPACKED_BANK.get(stored) != target and target not in exact.get(stored, ()):
                    groups.setdefault((stored, f"re-quantised into the {target} expert bank"), []).append(name)
        for name in self.weight_keys:
            info = self.file.tensor(self.weight_keys[name])
            if info.ggml_type in NATIVE_DTYPES:
                continue
            linear = self.packed_weight_dtype(name) if packed else None
            if linear is not None and PACKED_LINEAR.get(info.ggml_type) == linear:
                continue
            how = f"re-quantised to {linear}" if linear is not None else "decoded to bf16"
            for part in self._parts.get(name, (info.name,)):
                groups.setdefault((info.ggml_type, how), []).append(part)
        lines = []
        for (stored, how), names in groups.items():
            shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
            keep = (f"--experts-dtype {GGML_BANK} keeps them as stored" if "expert bank" in how and stored in ROW_TYPES
                    else f"moed keeps no {q.type_name(stored)} form there yet")
            lines.append(f"{len(names)} tensor(s) stored as {q.type_name(stored)} ({shown}) are {how}: {keep}")
        return lines

    def prefers_ggml(self) -> bool:
        """Whether the ggml bank keeps routed experts that ``default_bank_dtype()`` would re-quantise: every
        expert tensor is a type it keeps, and some do not repack into the default (a Q4_K_M file's Q6_K
        down, a Q5_K_M / Q6_K / Q3_K / IQ4_XS file). Where the default keeps them (Q8_0 -> q8, MXFP4 ->
        mxfp4, Q4_0/Q4_1/Q4_K -> int4 codes), the default stays: the same bits at least as fast; except for
        non-gated experts (Nemotron-H's relu^2), whose up matrix the ggml bank holds once and the others twice."""
        default = self.default_bank_dtype()
        types = {self.file.tensor(name).ggml_type for names in self._experts.values() for name in (names or ())[:3]}
        return bool(types) and types <= set(ROW_TYPES) and (
            self.config.moe.activation == "relu2" or any(REPACKED_BANK.get(t) != default for t in types))

    def ggml_bank_nbytes(self) -> int:
        """Bytes of the ggml bank (the expert tensors as stored, plus float32 biases)."""
        total = 0
        for names in self._experts.values():
            for name in set((names or ())[:3]):  # relu^2 experts: the up tensor is also the gate, held once
                total += self.file.tensor(name).nbytes
        moe = self.config.moe
        return total + (self.num_bank_rows * (2 * moe.intermediate_size + self.config.hidden_size) * 4
                        if moe.has_expert_bias else 0)

    def ggml_bank(self, activation: ExpertActivation) -> ExpertBank:
        """The routed experts kept as stored: each MoE layer's gate, up and down expert tensors read
        byte for byte into the ggml bank (cache/host_bank.py), each in its own GGML type; the
        biases (gpt-oss) as float32. One read per tensor, straight into the bank's memory."""
        config, moe = self.config, self.config.moe
        tensors: dict[str, torch.Tensor] = {}
        types: dict[str, int] = {}
        for layer in range(config.num_layers):
            names = self._experts[layer]
            if names is None:
                continue
            ml = config.moe_layer_index(layer)
            read: dict[str, torch.Tensor] = {}  # relu^2 experts name their up tensor as the gate: read once
            for kind, name in zip(("gate", "up", "down"), names[:3]):
                info = self.file.tensor(name)
                if name in read:
                    tensors[f"{kind}.{ml}"], types[f"{kind}.{ml}"] = read[name], info.ggml_type
                    continue
                if info.ggml_type not in ROW_TYPES:
                    raise InvalidRequestError(
                        f"{self.path}: expert tensor {quoted(name)} is {info.type_name}; the ggml bank keeps "
                        f"{', '.join(q.type_name(t) for t in ROW_TYPES)}: load it with another --experts-dtype "
                        f"(default {self.default_bank_dtype()})")
                experts, rows, k = info.shape
                bank = torch.empty(experts, rows, row_bytes(info.ggml_type, k), dtype=torch.uint8)
                self.file.read(name, out=bank)
                tensors[f"{kind}.{ml}"], types[f"{kind}.{ml}"] = bank, info.ggml_type
                read[name] = bank
        if moe.has_expert_bias:
            rows = [(torch.cat([self._dequantized(n[3]), self._dequantized(n[4])], dim=-1), self._dequantized(n[5]))
                    for n in self._experts.values() if n is not None]
            tensors["gate_up_bias"] = torch.cat([gu for gu, _ in rows]).contiguous()
            tensors["down_bias"] = torch.cat([dn for _, dn in rows]).contiguous()
        return ExpertBank(num_moe_layers=config.num_moe_layers, num_experts=moe.num_experts,
                          hidden_size=config.hidden_size, intermediate_size=moe.intermediate_size, dtype=GGML_BANK,
                          activation=activation, tensors=tensors, row_types=types)

    def expert_chunks(self, chunk_experts: int = CHUNK_EXPERTS, bank_dtype: str | None = None) -> Iterator[ExpertChunk]:
        """Every routed expert, in flat-id order, ``chunk_experts`` at a time (never across layers).

        Where the stored type repacks into ``bank_dtype`` (default: ``default_bank_dtype()``), the
        rows come packed in that layout; otherwise as float32 ``gate_up [n, D, 2I]`` (gate columns,
        then up) and ``down [n, I, D]``. When only one of the two matrices repacks (a Q4_K gate/up
        with a Q6_K down), the other is quantised to ``bank_dtype`` here, so the chunk is packed.
        """
        target = bank_dtype or self.default_bank_dtype()
        config, moe = self.config, self.config.moe
        for layer in range(config.num_layers):
            names = self._experts[layer]
            if names is None:
                continue
            gate, up, down, gate_b, up_b, down_b = names
            base = config.moe_layer_index(layer) * moe.num_experts
            gub = db = None
            if moe.has_expert_bias:
                gub = torch.cat([self._dequantized(gate_b), self._dequantized(up_b)], dim=-1)  # [E, 2I]
                db = self._dequantized(down_b)  # [E, D]
            for e0 in range(0, moe.num_experts, chunk_experts):
                e1 = min(moe.num_experts, e0 + chunk_experts)
                gate_up = self._matrix("gate_up", (gate, up), e0, e1, target)
                down_rows = self._matrix("down", (down,), e0, e1, target)
                biases = dict(gate_up_bias=None if gub is None else gub[e0:e1],
                              down_bias=None if db is None else db[e0:e1])
                if isinstance(gate_up, torch.Tensor) and isinstance(down_rows, torch.Tensor):
                    yield ExpertChunk(base + e0, gate_up, down_rows, **biases)
                    continue
                packed = {**_packed(gate_up, "gate_up", target), **_packed(down_rows, "down", target)}
                yield ExpertChunk(base + e0, packed=packed, packed_dtype=target, **biases)

    # ---- internals --------------------------------------------------------------------------------

    def _matrix(self, kind: str, parts: tuple[str, ...], e0: int, e1: int,
                target: str) -> torch.Tensor | dict[str, torch.Tensor]:
        """Experts ``e0 .. e1`` of one matrix kind, the GGUF tensors ``parts`` stacked along their
        rows (gate then up): bank tensors when the stored type repacks into ``target``, else float32
        k-major ``[n, K, rows]``."""
        infos = [self.file.tensor(p) for p in parts]
        n, k = e1 - e0, infos[0].shape[2]
        rows = sum(i.shape[1] for i in infos)
        types = {i.ggml_type for i in infos}
        if len(types) == 1 and REPACKED_BANK.get(infos[0].ggml_type) == target:
            # Repack the stacked [n, gate + up rows, K] source as one matrix: packing puts columns j and
            # j + Ncols/2 in one byte, so two separately packed halves would pair the wrong columns.
            raw = torch.cat([self.file.read(p, (e0, e1)).view(n, -1) for p in parts], dim=1).reshape(-1)
            tensors = _REPACKERS[target](raw, infos[0].ggml_type, (n, rows, k))
            return {f"{kind}.{suffix}": t for suffix, t in zip(_PACKED_PARTS[target], tensors)}
        stacked = torch.cat([self._dequantized(p, (e0, e1)) for p in parts], dim=1)  # [n, rows, K]
        return stacked.transpose(1, 2).contiguous()  # [n, K, rows]

    def _dequantized(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        info = self.file.tensor(name)
        shape = info.shape if rows is None else (rows[1] - rows[0], *info.shape[1:])
        return q.dequantize(self.file.read(name, rows), info.ggml_type, shape)

    def _joined(self, name: str) -> torch.Tensor:
        first, second = (self._dequantized(part) for part in self._parts[name])
        if name.endswith("kv_b_proj.weight"):
            return join_kv_b(first, second)
        la = self.config.linear_attention
        return join_qkvz(first, second, la.num_k_heads, la.k_head_dim)

    def _as_canonical(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Undo what llama.cpp changed in a stored value: Qwen3-Next's and Qwen3.5's 1 + w norms and
        -exp(A_log), and Qwen3.5's tiled value heads (gguf_names.py)."""
        if self.arch in ("nemotron_h_moe", "kimi-linear"):  # Mamba-2's / KDA's A_log stored as -exp(A_log)
            return torch.log(-tensor.float()) if name.endswith(".linear_attn.A_log") else tensor
        if self.arch not in ("qwen3next", "qwen35moe"):
            return tensor
        rel = layer_of(name)[1] if layer_of(name) else name
        if rel in PLUS_ONE_NORMS:
            return tensor.float() - 1.0
        if rel == "linear_attn.A_log":
            tensor = torch.log(-tensor.float())
        la = self.config.linear_attention
        per_key = la.num_v_heads // la.num_k_heads
        if self.arch != "qwen35moe" or per_key == 1 or not rel.startswith("linear_attn."):
            return tensor
        v_rows = untile_v_heads(la.num_k_heads, per_key, la.v_head_dim)
        if rel in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):  # q and k rows, then v
            keep = torch.arange(2 * la.key_dim)
            return tensor[torch.cat([keep, v_rows + 2 * la.key_dim])]
        if rel == "linear_attn.in_proj_z.weight":
            return tensor[v_rows]
        if rel in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.A_log",
                   "linear_attn.dt_bias"):
            return tensor[untile_v_heads(la.num_k_heads, per_key, 1)]
        if rel == "linear_attn.out_proj.weight":
            return tensor[:, v_rows]
        return tensor

    def _raw(self, name: str) -> torch.Tensor:
        """The stored bytes of the canonical weight ``name``, rows in Hugging Face's order (llama.cpp's
        "llama" architecture permuted Q/K rows: reordered here, whole rows of blocks, before decoding)."""
        info = self.file.tensor(self.weight_keys[name])
        raw = self.file.read(info.name)
        where = layer_of(name)
        if not self.spec.permuted_qk or where is None or where[1] not in PERMUTED_QK:
            return raw
        rows = info.shape[0]
        heads = getattr(self.config.attention, PERMUTED_QK[where[1]])
        return raw.view(rows, -1)[unpermute_rows(rows, heads)].reshape(-1)

    def _gguf_name(self, name: str) -> str:
        if name in GLOBAL_TENSORS:
            return GLOBAL_TENSORS[name]
        where = layer_of(name)
        if where is not None and where[1] == "post_attention_layernorm.weight":
            return f"blk.{self._block(*where)}.{self.spec.post_attention_norm}.weight"
        if where is None or where[1] not in LAYER_TENSORS:
            raise ModelFormatError(f"{self.path}: moed has no GGUF name for weight {quoted(name)} of a {self.arch} "
                                   "model (this architecture's mapping is incomplete)")
        layer, rel = where[0] if self._blocks is None else self._block(*where), where[1]
        gguf_name = f"blk.{layer}.{LAYER_TENSORS[rel]}"
        split = {"self_attn.kv_b_proj.weight": KV_B_PARTS, "linear_attn.in_proj_qkvz.weight": QKVZ_PARTS}.get(rel)
        if split is not None and (split == QKVZ_PARTS or gguf_name not in self.file):
            parts = tuple(f"blk.{layer}.{part}" for part in split)
            if all(part in self.file for part in parts):
                self._parts[name] = parts
                return parts[0]
        return gguf_name

    def _split_fused_experts(self) -> None:
        """A layer's experts stored as one ``ffn_gate_up_exps [E, 2I, D]`` (gate rows, then up: Gemma-4) are read
        as its ``ffn_gate_exps`` and ``ffn_up_exps``, row slices of the stored tensor (quantisation blocks never
        span rows)."""
        suffix = "ffn_gate_up_exps.weight"
        for name in [n for n in self.file.tensors if n.endswith(suffix)]:
            prefix = name[:-len(suffix)]
            if prefix + "ffn_gate_exps.weight" in self.file:
                continue
            rows = self.file.tensor(name).shape[1] if len(self.file.tensor(name).shape) == 3 else 1
            if rows % 2:
                raise ModelFormatError(f"{self.path}: tensor {quoted(name)} has an odd number of rows ({rows}), not gate "
                                       "and up halves; the file is corrupt")
            self.file.split_rows(name, {prefix + "ffn_gate_exps.weight": (0, rows // 2),
                                        prefix + "ffn_up_exps.weight": (rows // 2, rows)})

    def _block(self, layer: int, rel: str) -> int:
        """The GGUF block that holds ``rel`` of moed's ``layer``: the layer itself, or (Nemotron-H) its mixer
        block for the input norm and the mixer, its feed-forward block for the rest."""
        if self._blocks is None:
            return layer
        mixer, ffn = self._blocks[layer]
        if rel == "input_layernorm.weight" or rel.startswith(("self_attn.", "linear_attn.")) or ffn is None:
            return mixer
        return ffn

    def _expert_tensors(self, layer: int) -> tuple[str, ...] | None:
        """GGUF names of one MoE layer's routed experts: gate, up, down (+ their biases), or None. Non-gated
        experts (Nemotron-H's relu^2) have no gate: their up matrix is read in its place (the relu2 activation)."""
        if not self.config.moe_layers[layer]:
            return None
        b = f"blk.{self._block(layer, 'mlp.experts')}."
        gate = "ffn_up_exps.weight" if self.config.moe.activation == "relu2" else "ffn_gate_exps.weight"
        names = (b + gate, b + "ffn_up_exps.weight", b + "ffn_down_exps.weight")
        biases = (b + "ffn_gate_exps.bias", b + "ffn_up_exps.bias", b + "ffn_down_exps.bias")
        return names + (biases if self.config.moe.has_expert_bias else (None, None, None))

    def _check_weights(self) -> None:
        """Every tensor moed will read exists, has the shape the config implies and a type moed
        reads: a bad file fails here, before gigabytes are read."""
        for name, shape in self._shapes.items():
            if name in self._parts:
                self._check_parts(name)
                continue
            info = self._require(self.weight_keys[name])
            if math.prod(info.shape) != math.prod(shape) or (len(info.shape) == len(shape) and info.shape != shape):
                raise ModelFormatError(f"{self.path}: tensor {quoted(info.name)} has shape {list(info.shape)} but the "
                                       f"metadata implies {list(shape)}; the file is corrupt or not a {self.arch} model")
        moe, d = self.config.moe, self.config.hidden_size
        inter = moe.intermediate_size
        for layer, names in self._experts.items():
            if names is None:
                continue
            expected = [(moe.num_experts, inter, d), (moe.num_experts, inter, d), (moe.num_experts, d, inter)]
            if moe.has_expert_bias:
                expected += [(moe.num_experts, inter), (moe.num_experts, inter), (moe.num_experts, d)]
            for name, shape in zip(names, expected):
                info = self._require(name)
                if info.shape != shape:
                    raise ModelFormatError(f"{self.path}: expert tensor {quoted(name)} has shape {list(info.shape)} but "
                                           f"the metadata implies {list(shape)}; the file is corrupt or not a "
                                           f"{self.arch} model")

    def _check_parts(self, name: str) -> None:
        att, la, d = self.config.attention, self.config.linear_attention, self.config.hidden_size
        first, second = self._parts[name]
        if name.endswith("kv_b_proj.weight"):
            shapes = ((att.num_heads, att.kv_lora_rank, att.qk_nope_head_dim),
                      (att.num_heads, att.v_head_dim, att.kv_lora_rank))
        else:
            shapes = ((la.conv_dim, d), (la.value_dim, d))
        for part, expected in zip((first, second), shapes):
            info = self._require(part)
            if info.shape != expected:
                raise ModelFormatError(f"{self.path}: tensor {quoted(part)} has shape {list(info.shape)} but the "
                                       f"metadata implies {list(expected)}; the file is corrupt or not a {self.arch} "
                                       "model")

    def _require(self, name: str) -> GgufTensor:
        if name not in self.file:
            raise ModelFormatError(f"{self.path}: tensor {quoted(name)} is missing; the file is incomplete or was not "
                                   f"written by llama.cpp's converter for {self.arch}")
        info = self.file.tensor(name)
        if not q.readable(info.ggml_type):
            raise ModelFormatError(
                f"{self.path}: tensor {quoted(name)} is stored as {info.type_name}, which moed does not read "
                f"(it reads {', '.join(q.type_name(t) for t in (*q.SUPPORTED_TYPES, *q.decoded_types()))}); "
                f"{REQUANTISE}")
        return info


def _packed(rows: torch.Tensor | dict[str, torch.Tensor], kind: str, target: str) -> dict[str, torch.Tensor]:
    """Bank tensors of one matrix kind: repacked already, or float32 ``[n, K, N]`` quantised to ``target``."""
    if isinstance(rows, dict):
        return rows
    return {f"{kind}.{suffix}": t for suffix, t in zip(_PACKED_PARTS[target], _QUANTISERS[target](rows))}
