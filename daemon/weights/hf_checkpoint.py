"""Read a Hugging Face model directory (config.json + *.safetensors) in moed's canonical form, a piece at a time.

Non-expert tensors keep their HF names (MoE parts renamed, see models/families/) and are read
one by one in the checkpoint's dtype (float32, bf16 or fp16; anything else as float32); routed experts come as float32 k-major chunks of consecutive flat ids
(``gate_up [n, D, 2I]``, gate columns first, and ``down [n, I, D]``), so the converter and the
loader hold one chunk of experts at a time, never the whole pool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from moed.cache.expert_dtypes import EXPERT_DTYPES, GGML_BANK
from moed.cache.host_bank import ExpertActivation, ExpertBank
from moed.errors import InvalidRequestError, ModelFormatError, quoted
from moed.kernels import fp8_block_format as fb
from moed.kernels.ggml_rows_format import row_bytes
from moed.kernels.gguf_quants import NVFP4 as GGML_NVFP4
from moed.kernels.rows_format import FP8_BLOCK
from moed.layers.packed_linear import NVFP4_BLOCK, PackedLinear, can_pack
from moed.models.families import Family, family_of, parse_model_config
from moed.models.model_config import ModelConfig
from moed.weights.expert_chunk import ExpertChunk
from moed.weights.file_checks import require_regular_file
from moed.weights.fp8_blocks import FP8_DTYPES, MXFP4_METHOD, SCALE_SUFFIX, dequantize_fp8_blocks, fp8_config_of
from moed.weights.micro_scaled import MicroScaled, keeps_ggml_rows, micro_scaled_of
from moed.weights.safetensors_files import SafetensorsFiles

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
NATIVE_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK_EXPERTS = 16  # experts per chunk: a Qwen3-30B-A3B chunk is 16 x 4.7 MB x 2 (fp32) = 150 MB


def read_config_json(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file() and not file.exists():
        raise ModelFormatError(f"{path}: no config.json found; is this a Hugging Face model directory?")
    require_regular_file(file)
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{file}: expected a JSON object")
    return cfg


# the non-expert linears an FP8 load may keep as stored (names after "model.layers.{i}."): what linear()
# multiplies; MLA's kv_b_proj stays a tensor (the absorbed decode splits it per head), as do the router,
# the embeddings, the lm_head and the indexer's head weights (multiplied in their own dtype)
# the ggml row type each kept expert form loads into (HfCheckpoint.ggml_bank)
GGML_ROW_TYPE = {"nvfp4": GGML_NVFP4, "fp8": fb.FP8_B128, "mxfp8": fb.MXFP8}
def ggml_bank_bytes(kind: str, config: ModelConfig, rows: int) -> int:
    """Bytes of a ggml bank of ``rows`` experts kept as ``kind`` ("nvfp4": NVFP4 rows and a float32 factor per
    expert matrix; "fp8" / "mxfp8": FP8_B128 / MXFP8 rows)."""
    d, inter = config.hidden_size, config.moe.intermediate_size
    mats = 2 if config.moe.activation == "relu2" else 3  # non-gated experts: the up matrix is the gate too, held once
    if kind == "nvfp4":
        return rows * (mats * d * inter // 64 * 36 + mats * 4)
    weights, size = fb.BLOCK_SIZES[GGML_ROW_TYPE[kind]]
    return rows * (mats * d * inter // weights * size)


FP8_KEPT_LINEARS = frozenset({
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "mlp.shared.gate_proj.weight", "mlp.shared.up_proj.weight", "mlp.shared.down_proj.weight",
    "self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight",  # DeepSeek-V3.2 / GLM-5's indexer
    # DeepSeek-V4 (its own names): the query, the shared K=V head, the output's mix, the compressors and indexer
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight", "attn.indexer.wq_b.weight",
    "attn.compressor.wkv.weight", "attn.compressor.wgate.weight", "attn.indexer.compressor.wkv.weight",
    "attn.indexer.compressor.wgate.weight"})


class HfCheckpoint:
    """One Hugging Face directory: config parsed, tensor names mapped; data read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.raw_config = read_config_json(self.path)
        where = str(self.path / "config.json")
        self.family: Family = family_of(self.raw_config, where=where)
        self.config: ModelConfig = parse_model_config(self.raw_config, where=where)
        self.fp8 = fp8_config_of(self.raw_config, where)
        quant = self.raw_config.get("quantization_config")
        self.is_mxfp4 = isinstance(quant, dict) and quant.get("quant_method") == MXFP4_METHOD
        self.micro: MicroScaled | None = micro_scaled_of(self.raw_config, self.path, where)  # NVFP4 / MXFP8
        self.source = SafetensorsFiles(self.path)
        self.source.rename(_reader_names(self.family, self.config, set(self.source.keys())))
        # DeepSeek-V4's published experts: two E2M1 values a byte (int8 [rows, K/2]) and an E8M0 scale per 32
        self.fp4_experts = "fp4" in (self.raw_config.get("expert_dtype"), (quant or {}).get("expert_dtype"))
        self.weight_keys = _canonical_keys(self.config, self.family, self.source.keys(), self.micro)  # canonical -> HF
        # a CPU-only load keeps the FP8 / NVFP4 linears as stored (keep_fp8_linears)
        self.keep_fp8 = False

    def keep_fp8_linears(self, keep: bool) -> None:
        """Whether ``packed_weight_dtype`` keeps quantised linears as stored instead of widening them to bf16:
        block-scaled FP8 ones with 128-wide blocks ("fp8" PackedLinear: 1 byte a weight and a scale per 128)
        NVFP4 ones ("nvfp4": llama.cpp NVFP4 rows, 4.5 bits a weight, and the tensor's factor) and MXFP8 ones
        ("mxfp8": moed's MXFP8 rows, 8.25 bits a weight), on a
        CPU-only load: the layer-by-layer decode of MLA and hybrid models and the native decode chain of GQA
        models multiply them as stored. A device multiplies plain tensors: a device load keeps bf16."""
        self.keep_fp8 = bool(keep)

    def packed_weight_dtype(self, name: str) -> str | None:
        """"fp8" / "nvfp4" / "mxfp8" for a non-expert linear a load keeps as stored (``keep_fp8_linears``), else None."""
        if not self.keep_fp8:
            return None
        rel = name.partition(".layers.")[2].partition(".")[2] if ".layers." in name else None
        key = self.weight_keys.get(name)
        if rel not in FP8_KEPT_LINEARS or key is None:
            return None
        if self._quantised(key):
            shape = self._shape(key)
            kind = self.micro.kind  # "nvfp4" (llama.cpp NVFP4 rows) or "mxfp8" (moed's MXFP8 rows)
        elif self.fp8 is not None and self.fp8.block[1] == FP8_BLOCK and self.source.dtype(key) == torch.float8_e4m3fn:
            shape, kind = self.source.shape(key), "fp8"
        else:
            return None
        return kind if kind and len(shape) == 2 and can_pack(shape[1], shape[0], kind) else None

    def read_packed_weight(self, name: str) -> PackedLinear:
        """One weight ``packed_weight_dtype`` keeps: FP8 codes as stored with their block scales per row, or
        NVFP4 codes and scales moved into llama.cpp NVFP4 rows with the tensor's factor (no value changes)."""
        key = self.weight_keys[name]
        if self.packed_weight_dtype(name) == "mxfp8":
            n, k = self._shape(key)
            rows = torch.empty(n, row_bytes(fb.MXFP8, k), dtype=torch.uint8)
            self.micro.mxfp8_rows(self.source, key, rows)
            return PackedLinear("mxfp8", (rows, torch.ones(1)), k, n)
        if self.packed_weight_dtype(name) == "nvfp4":
            n, k = self._shape(key)
            rows = torch.empty(1, n, k // NVFP4_BLOCK * 36, dtype=torch.uint8)
            factor = self.micro.ggml_rows(self.source, [key], rows)
            return PackedLinear("nvfp4", (rows[0], factor.reshape(1).float().contiguous()), k, n)
        codes = self.source.get(key, None)
        scale_key = key + SCALE_SUFFIX
        if scale_key not in self.source:
            raise ModelFormatError(f"{self.source.entries[key].file}: tensor {quoted(key)} is FP8 but "
                                   f"{quoted(scale_key)} is missing; block-scaled FP8 needs both (is the checkpoint "
                                   "complete?)")
        n, k = codes.shape
        rows = self.fp8.block[0]
        scale = self.source.get(scale_key, torch.float32)
        if tuple(scale.shape) != (-(-n // rows), k // FP8_BLOCK):
            raise ModelFormatError(f"{self.source.entries[key].file}: {quoted(scale_key)} has shape {list(scale.shape)}, "
                                   f"but a {[n, k]} weight in {rows}x{FP8_BLOCK} blocks needs "
                                   f"{[-(-n // rows), k // FP8_BLOCK]}")
        per_row = scale.repeat_interleave(rows, dim=0)[:n].contiguous()
        return PackedLinear("fp8", (codes.view(torch.uint8).contiguous(), per_row), k, n)

    @property
    def num_bank_rows(self) -> int:
        return self.config.num_moe_layers * self.config.moe.num_experts

    def default_bank_dtype(self) -> str:
        """The bank dtype that holds the routed experts without loss, or with the least: MXFP4 experts
        stay mxfp4 (bit for bit); bf16 experts stay bf16; FP8 experts become bf16 (one rounding of
        fp8 x block scale, 1/16 of an FP8 step); fp16 and fp32 experts need fp32 to stay exact."""
        if self.is_mxfp4 or self.fp4_experts:
            return "mxfp4"
        if self.fp8 is not None:
            return "bf16"
        micro = self._micro_experts()
        if micro is not None:  # MXFP8 is bf16 exactly; NVFP4 becomes int4 where the ggml bank does not keep it
            return "bf16" if micro.kind == "mxfp8" else "int4"
        stored = self._expert_storage_dtype()
        return "bf16" if stored == torch.bfloat16 else "fp32"

    def _expert_storage_dtype(self) -> torch.dtype | None:
        names = self.family.names
        for layer in range(self.config.num_layers):
            if self.config.moe_layers[layer]:
                prefix = names.moe_prefix.format(i=layer) + "."
                key = prefix + (names.fused_down or names.expert_down.format(e=0))
                return self.source.dtype(key) if key in self.source else None
        return None

    def _micro_experts(self) -> MicroScaled | None:
        """The NVFP4 / MXFP8 layout when the routed experts are stored in it."""
        if self.micro is None:
            return None
        key = self._first_expert_key()
        return self.micro if key is not None and self.micro.is_quantised(self.source, self.micro.data_key(key)) \
            else None

    def _first_expert_key(self) -> str | None:
        names = self.family.names
        for layer in range(self.config.num_layers):
            if self.config.moe_layers[layer] and not names.fused_down:
                return names.moe_prefix.format(i=layer) + "." + names.expert_down.format(e=0)
        return None

    def _data_key(self, key: str) -> str:
        return self.micro.data_key(key) if self.micro is not None else key

    def _ggml_kind(self) -> str | None:
        """The routed experts' stored form the ggml bank keeps as stored, or None: "nvfp4" (llama.cpp NVFP4 rows:
        whole 64-weight blocks), "fp8" (block-scaled FP8 with 128-wide blocks: moed's FP8_B128 rows) or
        "mxfp8" (MXFP8 rows); every other bank converts them."""
        d, inter = self.config.hidden_size, self.config.moe.intermediate_size
        micro = self._micro_experts()
        if micro is not None:
            if micro.kind == "nvfp4" and keeps_ggml_rows(d) and keeps_ggml_rows(inter):
                return "nvfp4"
            return "mxfp8" if micro.kind == "mxfp8" and d % 32 == 0 and inter % 32 == 0 else None
        key = self._first_expert_key()
        if self.fp8 is not None and self.fp8.block[1] == FP8_BLOCK and d % FP8_BLOCK == 0 and inter % FP8_BLOCK == 0 \
                and key is not None and key in self.source and self.source.dtype(key) == torch.float8_e4m3fn:
            return "fp8"
        return None

    def prefers_ggml(self) -> bool:
        """Whether the ggml bank keeps the routed experts as stored (``_ggml_kind``): NVFP4, block-scaled FP8 and
        MXFP8 experts at 4.5 / 8.25 / 8.25 bits a weight, where every other bank would change them (NVFP4 -> int4)
        or widen them to bf16 (FP8 and MXFP8: twice the memory)."""
        return self._ggml_kind() is not None

    def ggml_bank_nbytes(self) -> int | None:
        """Bytes of the ggml bank (the rows, and for NVFP4 a float32 factor per expert matrix), None without one."""
        kind = self._ggml_kind()
        return None if kind is None else ggml_bank_bytes(kind, self.config, self.num_bank_rows)

    def ggml_bank(self, activation: ExpertActivation) -> ExpertBank:
        """The routed experts kept block for block (``_ggml_kind``): each expert matrix's codes and scales moved
        into rows of one ggml type, no value changed: NVFP4 into llama.cpp NVFP4 rows with its per-tensor factor
        beside them (``{kind}.{layer}.scale``, applied to the outputs by the kernels); block-scaled FP8 into
        FP8_B128 rows (each row's 128-wide blocks with their float32 scale); MXFP8 into MXFP8 rows."""
        kind = self._ggml_kind()
        if kind is None:
            raise InvalidRequestError(
                f"--experts-dtype {GGML_BANK} keeps a GGUF file's own block types, or an NVFP4, FP8 or MXFP8 "
                f"checkpoint's blocks; {self.path} is a Hugging Face directory without such experts in whole blocks: "
                f"choose one of {', '.join(EXPERT_DTYPES)}")
        config, names, moe = self.config, self.family.names, self.config.moe
        d, inter, num_experts = config.hidden_size, moe.intermediate_size, moe.num_experts
        ggml_type = GGML_ROW_TYPE[kind]
        tensors: dict[str, torch.Tensor] = {}
        types: dict[str, int] = {}
        for layer in range(config.num_layers):
            if not config.moe_layers[layer]:
                continue
            ml = config.moe_layer_index(layer)
            prefix = names.moe_prefix.format(i=layer) + "."
            for part, pattern, rows, k in (("gate", names.expert_gate or names.expert_up, inter, d),
                                           ("up", names.expert_up, inter, d),
                                           ("down", names.expert_down, d, inter)):
                if part == "up" and not names.expert_gate:  # non-gated (relu^2) experts: the gate is the up, held once
                    for suffix in ("", ".scale"):
                        if f"gate.{ml}{suffix}" in tensors:
                            tensors[f"up.{ml}{suffix}"] = tensors[f"gate.{ml}{suffix}"]
                    types[f"up.{ml}"] = types[f"gate.{ml}"]
                    continue
                bank = torch.empty(num_experts, rows, row_bytes(ggml_type, k), dtype=torch.uint8)
                keys = [self._data_key(prefix + pattern.format(e=e)) for e in range(num_experts)]
                for key in keys:
                    if self._shape(key) != (rows, k) or (kind != "fp8" and not self._quantised(key)) \
                            or (kind == "fp8" and self.source.dtype(key) != torch.float8_e4m3fn):
                        raise ModelFormatError(f"{self.path}: expert tensor {quoted(key)} is not a {kind.upper()} "
                                               f"weight of shape [{rows}, {k}] like the layer's others")
                if kind == "nvfp4":
                    tensors[f"{part}.{ml}.scale"] = self.micro.ggml_rows(self.source, keys, bank)
                else:
                    for e, key in enumerate(keys):
                        self._fp8_rows(kind, key, bank[e])
                tensors[f"{part}.{ml}"], types[f"{part}.{ml}"] = bank, ggml_type
        return ExpertBank(num_moe_layers=config.num_moe_layers, num_experts=num_experts, hidden_size=d,
                          intermediate_size=inter, dtype=GGML_BANK, activation=activation, tensors=tensors,
                          row_types=types)

    def _fp8_rows(self, kind: str, key: str, out: torch.Tensor) -> None:
        """One FP8 (block-scaled) or MXFP8 expert matrix moved into FP8_B128 / MXFP8 rows ``out``."""
        if kind == "mxfp8":
            self.micro.mxfp8_rows(self.source, key, out)
            return
        scale_key = key + SCALE_SUFFIX
        if scale_key not in self.source:
            raise ModelFormatError(f"{self.source.entries[key].file}: tensor {quoted(key)} is FP8 but "
                                   f"{quoted(scale_key)} is missing; block-scaled FP8 needs both (is the checkpoint "
                                   "complete?)")
        n, k = self.source.shape(key)
        try:
            fb.fp8_b128_rows(self.source.get(key, None), self.source.get(scale_key, torch.float32), out,
                             row_block=self.fp8.block[0])
        except ValueError as exc:
            raise ModelFormatError(f"{self.source.entries[key].file}: {quoted(scale_key)}: {exc}") from None

    def type_changes(self, bank_dtype: str, packed: bool = True) -> list[str]:
        """What a load in ``bank_dtype`` changes in an NVFP4 / MXFP8 checkpoint, one line per kind of change
        (nothing changes silently, as for GGUF files); ``packed`` is accepted for the GGUF interface."""
        micro = self.micro
        if micro is None:
            return []
        lines = []
        experts = self._micro_experts()
        lossless = {"nvfp4": (GGML_BANK, "fp32"), "mxfp8": (GGML_BANK, "bf16", "fp32")}
        if experts is not None and bank_dtype not in lossless[micro.kind]:
            lines.append(f"the routed experts stored as {micro.label} are converted into the {bank_dtype} expert "
                         f"bank, which changes their values" + (": --experts-dtype ggml keeps NVFP4 experts as stored (the default on a CPU-only machine)"
                                    if micro.kind == "nvfp4" else ""))
        linears = [name for name, key in self.weight_keys.items()
                   if self._quantised(key) and self.packed_weight_dtype(name) is None]  # kept ones change nothing
        if linears and micro.kind == "nvfp4":
            shown = ", ".join(linears[:2]) + (f" and {len(linears) - 2} more" if len(linears) > 2 else "")
            lines.append(f"{len(linears)} non-expert weight(s) stored as {micro.label} ({shown}) are decoded to bf16 "
                         "(one rounding of each value): moed keeps no NVFP4 form for them yet")
        return lines

    def _quantised(self, key: str) -> bool:
        return self.micro is not None and self.micro.is_quantised(self.source, key)

    def _shape(self, key: str) -> tuple[int, ...]:
        return self.micro.shape(self.source, key) if self._quantised(key) else self.source.shape(key)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: _flat_score_bias(name, self._shape(key)) for name, key in self.weight_keys.items()}

    def weight_dtype(self, name: str) -> torch.dtype:
        """The dtype a non-expert weight is kept in: the checkpoint's own when it is float32, bf16 or
        fp16 (computed with float32 accumulation, see layers/linear.py), bf16 for FP8, MXFP8 and NVFP4
        weights (their scales applied; exact but for NVFP4's per-tensor factor), else float32."""
        key = self.weight_keys[name]
        stored = self.source.dtype(key)
        if stored in FP8_DTYPES or self._quantised(key):
            return torch.bfloat16
        if not stored.is_floating_point:  # an index table (DeepSeek-V4's tid2eid) keeps its integers
            return stored
        return stored if stored in NATIVE_WEIGHT_DTYPES else torch.float32

    def read_weight(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One non-expert weight, in ``dtype`` (default: ``weight_dtype(name)``)."""
        tensor = self._read(self.weight_keys[name]).to(dtype or self.weight_dtype(name)).contiguous()
        return tensor.reshape(_flat_score_bias(name, tuple(tensor.shape)))

    def _read(self, key: str) -> torch.Tensor:
        """A tensor as float32 (FP8 block scales applied), or in its own dtype when that is bf16/fp16/fp32."""
        if self._quantised(key):
            return self.micro.read(self.source, key)
        stored = self.source.dtype(key)
        if stored not in FP8_DTYPES:
            return self.source.get(key, None if stored in NATIVE_WEIGHT_DTYPES else torch.float32)
        scale_key = key + SCALE_SUFFIX
        if self.fp8 is None or scale_key not in self.source:
            raise ModelFormatError(
                f"{self.source.entries[key].file}: tensor {quoted(key)} is FP8 but "
                + ("config.json has no quantization_config" if self.fp8 is None else f"{quoted(scale_key)} is missing")
                + "; block-scaled FP8 needs both (is the checkpoint complete?)")
        return dequantize_fp8_blocks(self.source.get(key, None), self.source.get(scale_key), self.fp8.block,
                                     f"{self.source.entries[key].file}: {quoted(key)}")

    def expert_chunks(self, chunk_experts: int = CHUNK_EXPERTS, bank_dtype: str | None = None) -> Iterator[ExpertChunk]:
        """Every routed expert, in flat-id order, ``chunk_experts`` at a time (never across layers).
        MXFP4 experts come as packed mxfp4 bank rows (``bank_rows`` converts them if ``bank_dtype``
        is another dtype); everything else as float32."""
        config, names, moe = self.config, self.family.names, self.config.moe
        d, inter, num_experts = config.hidden_size, moe.intermediate_size, moe.num_experts
        for layer in range(config.num_layers):
            if not config.moe_layers[layer]:
                continue
            base = config.moe_layer_index(layer) * num_experts
            prefix = names.moe_prefix.format(i=layer) + "."
            if names.fused_gate_up and prefix + names.fused_gate_up + "_blocks" in self.source:
                yield from self._mxfp4_chunks(prefix, base, chunk_experts)
                continue
            if names.fused_gate_up:  # gpt-oss: one tensor per layer holds every expert
                if names.fused_transposed:  # Gemma-4: [E, 2I, D] and [E, D, I], rows as nn.Linear keeps them
                    fused = self._shaped(prefix + names.fused_gate_up, (num_experts, 2 * inter, d)).transpose(1, 2)
                else:
                    fused = self._shaped(prefix + names.fused_gate_up, (num_experts, d, 2 * inter))
                if names.fused_interleaved:
                    gate_up = torch.cat([fused[..., 0::2], fused[..., 1::2]], dim=-1)  # interleaved -> gate | up
                else:
                    gate_up = fused  # already gate | up
                del fused
                down = self._shaped(prefix + names.fused_down, (num_experts, d, inter)).transpose(1, 2) \
                    if names.fused_transposed else self._shaped(prefix + names.fused_down, (num_experts, inter, d))
                gub = db = None
                if moe.has_expert_bias:
                    bias = self._shaped(prefix + names.fused_gate_up + "_bias", (num_experts, 2 * inter))
                    gub = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
                    db = self._shaped(prefix + names.fused_down + "_bias", (num_experts, d))
                for e0 in range(0, num_experts, chunk_experts):
                    e1 = min(num_experts, e0 + chunk_experts)
                    yield ExpertChunk(base + e0, gate_up[e0:e1].contiguous(), down[e0:e1].contiguous(),
                                      None if gub is None else gub[e0:e1], None if db is None else db[e0:e1])
                continue
            if self.fp4_experts:
                yield from self._fp4_chunks(prefix, base, chunk_experts)
                continue
            for e0 in range(0, num_experts, chunk_experts):
                e1 = min(num_experts, e0 + chunk_experts)
                gate_up = torch.empty(e1 - e0, d, 2 * inter)
                down = torch.empty(e1 - e0, inter, d)
                for i, e in enumerate(range(e0, e1)):
                    up = self._shaped(prefix + names.expert_up.format(e=e), (inter, d)).t()
                    # a non-gated expert (Nemotron-H's relu(up)^2, no gate tensor): its up matrix in both halves
                    gate_up[i, :, :inter] = self._shaped(prefix + names.expert_gate.format(e=e), (inter, d)).t() \
                        if names.expert_gate else up
                    gate_up[i, :, inter:] = up
                    down[i] = self._shaped(prefix + names.expert_down.format(e=e), (d, inter)).t()
                yield ExpertChunk(base + e0, gate_up, down)

    def _mxfp4_chunks(self, prefix: str, base: int, chunk_experts: int) -> Iterator[ExpertChunk]:
        """gpt-oss MXFP4 experts of one layer: ``*_blocks [E, rows, K/32, 16]`` + ``*_scales [E, rows, K/32]``
        repacked bit for bit into mxfp4 bank rows (gate_up's interleaved gate/up rows reordered to
        gate | up, the order of every bank)."""
        from moed.kernels.mxfp4_format import from_gpt_oss_blocks

        names, moe = self.family.names, self.config.moe
        d, inter, num_experts = self.config.hidden_size, moe.intermediate_size, moe.num_experts
        gu, dn = prefix + names.fused_gate_up, prefix + names.fused_down
        if not self.is_mxfp4:
            raise ModelFormatError(f"{self.path}: {quoted(gu + '_blocks')} holds MXFP4 experts but config.json's "
                                   "quantization_config is not mxfp4; the config and the weights do not belong together")
        order = torch.cat([torch.arange(0, 2 * inter, 2), torch.arange(1, 2 * inter, 2)])  # interleaved -> gate | up
        gu_blocks = self._packed(gu + "_blocks", (num_experts, 2 * inter, d // 32, 16))[:, order]
        gu_scales = self._packed(gu + "_scales", (num_experts, 2 * inter, d // 32))[:, order]
        dn_blocks = self._packed(dn + "_blocks", (num_experts, d, inter // 32, 16))
        dn_scales = self._packed(dn + "_scales", (num_experts, d, inter // 32))
        gub = db = None
        if moe.has_expert_bias:
            bias = self._shaped(gu + "_bias", (num_experts, 2 * inter))
            gub = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
            db = self._shaped(dn + "_bias", (num_experts, d))
        for e0 in range(0, num_experts, chunk_experts):
            e1 = min(num_experts, e0 + chunk_experts)
            gu_fp4, gu_e8m0 = from_gpt_oss_blocks(gu_blocks[e0:e1].contiguous(), gu_scales[e0:e1].contiguous())
            dn_fp4, dn_e8m0 = from_gpt_oss_blocks(dn_blocks[e0:e1].contiguous(), dn_scales[e0:e1].contiguous())
            packed = {"gate_up.fp4": gu_fp4, "gate_up.e8m0": gu_e8m0, "down.fp4": dn_fp4, "down.e8m0": dn_e8m0}
            yield ExpertChunk(base + e0, gate_up_bias=None if gub is None else gub[e0:e1],
                              down_bias=None if db is None else db[e0:e1], packed=packed, packed_dtype="mxfp4")

    def _fp4_chunks(self, prefix: str, base: int, chunk_experts: int) -> Iterator[ExpertChunk]:
        """DeepSeek-V4's FP4 experts of one layer (``expert_dtype: "fp4"``): each projection's weight int8
        ``[rows, K/2]`` (two E2M1 codes a byte, the low nibble first) and its scale E8M0 ``[rows, K/32]`` are
        gpt-oss's MXFP4 blocks under other shapes: moved bit for bit into mxfp4 bank rows."""
        from moed.kernels.mxfp4_format import from_gpt_oss_blocks

        names, moe = self.family.names, self.config.moe
        d, inter, num_experts = self.config.hidden_size, moe.intermediate_size, moe.num_experts

        def blocks(pattern: str, e: int, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            key = prefix + pattern.format(e=e)
            scale_key = key + SCALE_SUFFIX
            if key not in self.source or scale_key not in self.source:
                raise ModelFormatError(f"{self.path}: FP4 expert tensor {quoted(key)} or its scale is missing "
                                       "(config.json says expert_dtype fp4); is the checkpoint complete?")
            for name, dtypes, shape in ((key, (torch.int8, torch.uint8), (rows, k // 2)),
                                        (scale_key, (torch.float8_e8m0fnu, torch.uint8), (rows, k // 32))):
                if self.source.dtype(name) not in dtypes or self.source.shape(name) != shape:
                    raise ModelFormatError(
                        f"{self.source.entries[name].file}: FP4 expert tensor {quoted(name)} is "
                        f"{self.source.dtype(name)} {list(self.source.shape(name))}, but config.json (expert_dtype fp4) "
                        f"implies {dtypes[0]} {list(shape)}; the config and the weights do not belong together")
            return (self.source.get(key, None).view(torch.uint8).reshape(rows, k // 32, 16),
                    self.source.get(scale_key, None).view(torch.uint8))

        if d % 32 or inter % 32:
            raise ModelFormatError(f"{self.path}: FP4 experts need hidden_size and moe_intermediate_size to be "
                                   f"multiples of 32, got {d} and {inter}")
        for e0 in range(0, num_experts, chunk_experts):
            experts = range(e0, min(num_experts, e0 + chunk_experts))
            gu = [[blocks(p, e, inter, d) for p in (names.expert_gate or names.expert_up, names.expert_up)]
                  for e in experts]
            dn = [blocks(names.expert_down, e, d, inter) for e in experts]
            try:
                gu_fp4, gu_e8m0 = from_gpt_oss_blocks(torch.stack([torch.cat([g[0], u[0]]) for g, u in gu]),
                                                      torch.stack([torch.cat([g[1], u[1]]) for g, u in gu]))
                dn_fp4, dn_e8m0 = from_gpt_oss_blocks(torch.stack([b for b, _ in dn]), torch.stack([s for _, s in dn]))
            except ValueError as exc:
                raise ModelFormatError(f"{self.path}: the FP4 experts of {prefix.rstrip('.')}: {exc}") from None
            packed = {"gate_up.fp4": gu_fp4, "gate_up.e8m0": gu_e8m0, "down.fp4": dn_fp4, "down.e8m0": dn_e8m0}
            yield ExpertChunk(base + e0, packed=packed, packed_dtype="mxfp4")

    def _packed(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A uint8 tensor of packed MXFP4 data, shape checked against the config."""
        if key not in self.source:
            raise ModelFormatError(f"{self.path}: MXFP4 expert tensor {quoted(key)} is missing (config.json expects "
                                   f"shape {list(shape)}); is the checkpoint complete?")
        got, dtype = self.source.shape(key), self.source.dtype(key)
        if got != shape or dtype != torch.uint8:
            raise ModelFormatError(f"{self.path}: MXFP4 tensor {quoted(key)} is {dtype} {list(got)} but config.json "
                                   f"implies uint8 {list(shape)}; the config and the weights do not belong together")
        return self.source.get(key, None)

    def _shaped(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        key = self._data_key(key)
        if key not in self.source:
            raise ModelFormatError(
                f"{self.path}: expert tensor {quoted(key)} is missing (config.json expects shape {list(shape)})")
        got = self._shape(key)
        if got != shape:
            raise ModelFormatError(
                f"{self.path}: tensor {quoted(key)} has shape {list(got)} but config.json implies {list(shape)}; "
                "the config and the weights do not belong together")
        return self._read(key).float()


def _flat_score_bias(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A router's correction bias stored as [1, E] (ERNIE-4.5, one expert group) is the [E] vector moed keeps."""
    if name.endswith("router.score_bias") and len(shape) == 2 and shape[0] == 1:
        return (shape[1],)
    return shape


def _reader_names(family: Family, config: ModelConfig, keys: set[str]):
    """The name moed reads each stored tensor by: the family's ``renames`` (a published layout -> transformers'
    names) and those its config implies (``ModelConfig.tensor_renames``), and DeepSeek's ``X.scale`` beside an ``X.weight`` as ``X.weight_scale_inv`` (one name for every
    block-scaled FP8 / FP4 weight's scales)."""
    renames = [(re.compile(pattern), repl) for pattern, repl in (*family.names.renames, *config.tensor_renames)]

    def name(key: str) -> str:
        if key.endswith(".scale") and key[:-len("scale")] + "weight" in keys:
            key = key[:-len("scale")] + "weight" + SCALE_SUFFIX
        for pattern, repl in renames:
            key = pattern.sub(repl, key)
        return key
    return name


def _canonical_keys(config: ModelConfig, family: Family, keys: list[str], micro: MicroScaled | None = None
                    ) -> dict[str, str]:
    """Canonical non-expert weight name -> the HF tensor that holds it (routed experts excluded; an
    NVFP4 / MXFP8 weight's scales are read with it)."""
    names = family.names
    renames = {names.router + ".weight": "router.weight"}
    if names.router_bias:
        renames[names.router_bias] = "router.bias"
    if names.score_bias:
        renames[names.score_bias] = "router.score_bias"
    if names.router_input_scale:
        renames[names.router_input_scale] = "router.input_scale"
    if names.router_expert_scale:
        renames[names.router_expert_scale] = "router.expert_scale"
    if names.shared:
        for part, canonical in zip(names.shared_parts, ("gate_proj", "up_proj", "down_proj")):
            renames[f"{names.shared}.{part}.weight"] = f"shared.{canonical}.weight"
    if names.router_table:
        renames[names.router_table] = "router.tid2eid"
    if names.shared_gate:
        renames[names.shared_gate + ".weight"] = "shared_gate.weight"
    mapping: dict[str, str] = {}
    for hf_key in keys:
        key = micro.canonical(hf_key) if micro is not None else hf_key
        if key is None:
            continue  # an NVFP4 / MXFP8 scale: read with its weight
        if names.skip_prefixes and key.startswith(names.skip_prefixes):
            continue  # a vision tower, multi-token prediction: not used for text generation
        name = key
        if names.language_prefix and key.startswith(names.language_prefix):
            key = "model." + key[len(names.language_prefix):]  # its canonical name
        match = _LAYER.match(key)
        layer = int(match.group(1)) if match else None
        if layer is not None and layer >= config.num_layers:
            continue  # e.g. DeepSeek's multi-token-prediction layers: not used for generation
        if key.endswith("rotary_emb.inv_freq") or key.endswith(SCALE_SUFFIX):
            continue  # FP8 block scales are read with their weights
        if key == names.lm_head and key != "lm_head.weight":
            mapping["lm_head.weight"] = hf_key
            continue
        if layer is not None and config.moe_layers[layer]:
            prefix = names.moe_prefix.format(i=layer) + "."
            if name.startswith(prefix):
                rel = name[len(prefix):]
                if rel in renames:
                    mapping[f"model.layers.{layer}.mlp.{renames[rel]}"] = hf_key
                # routed experts (rel starts with "experts.") are read by expert_chunks
                continue
        mapping[key] = hf_key
    return mapping
