"""Open a model directory, Hugging Face or FTW, into config + weights + host expert bank."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from moed.cache.bank_builder import bank_tensor_specs
from moed.cache.expert_dtypes import GGML_BANK
from moed.cache.host_bank import EXPERT_DTYPES, INT4_GROUP_SIZE, ExpertActivation, ExpertBank
from moed.cache.kv_cache import kv_dtype_for
from moed.errors import InvalidRequestError, ModelFormatError
from moed.layers.packed_linear import PackedLinear
from moed.models.families import parse_model_config
from moed.models.model_config import ModelConfig
from moed.weights.ftw_reader import load_ftw, read_ftw_index
from moed.weights.file_checks import require_regular_file
from moed.weights.expert_chunk import bank_rows
from moed.weights.checkpoint import (FTW_INDEX, Checkpoint, LoadBytes, checkpoint_load_bytes, is_ftw_dir,
                                     open_checkpoint, source_kind)

BANK_PREFIX = "experts."


@dataclass
class LoadedModel:
    path: Path
    format: str  # "hf" | "ftw" | "gguf"
    config: ModelConfig
    weights: dict[str, torch.Tensor | PackedLinear]  # PackedLinear: a GGUF's quantised linear() weights
    bank: ExpertBank
    tokenizer_files: dict[str, str] | None = None  # GGUF: tokenizer.json etc. built from its metadata


log = logging.getLogger("moed.weights")

WEIGHT_DTYPES = ("auto", "fp32")  # auto: the checkpoint's own (float32, bf16 or fp16)


def load_model(path: str | Path, *, experts_dtype: str | None = None, verify: bool = False,
               progress: Callable[[int, int], None] | None = None, weights_dtype: str = "auto",
               cpu_only: bool = False) -> LoadedModel:
    """``experts_dtype`` applies to HF directories and GGUF files (default: the checkpoint's
    ``default_bank_dtype``, lossless or closest); FTW banks load as they were written.
    ``weights_dtype`` is the non-expert weights' dtype at run time: "auto" keeps what the files hold,
    "fp32" widens them (exact float32 arithmetic, twice the memory of bf16). ``cpu_only``: the experts
    will run on the CPU, so a GGUF file whose experts the default bank would re-quantise loads them as
    stored instead (the ggml bank, ``GgufCheckpoint.prefers_ggml``); with a device the default bank stays, whose
    kernels are measured on a GPU (``--experts-dtype ggml`` runs the kept types there too: experts/ggml_slots.py)."""
    if weights_dtype not in WEIGHT_DTYPES:
        raise InvalidRequestError(f"weights dtype {weights_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    loaded = _load(Path(path), experts_dtype, verify, progress, weights_dtype, cpu_only)
    if weights_dtype == "fp32":
        loaded.weights = {name: t.dequantize(torch.float32) if isinstance(t, PackedLinear) else t.float()
                          for name, t in loaded.weights.items()}
    return loaded


def _bank_dtype(checkpoint, kind: str, experts_dtype: str | None, cpu_only: bool) -> str:
    """The bank a Hugging Face or GGUF load builds: the one asked for, else on a CPU-only machine a GGUF
    file's (or an NVFP4, FP8 or MXFP8 checkpoint's) experts as stored where another bank would change or widen them,
    else the checkpoint's default."""
    if experts_dtype is None and kind != "ftw" and cpu_only and checkpoint.prefers_ggml():
        return GGML_BANK
    return experts_dtype or checkpoint.default_bank_dtype()


def _load(path: Path, experts_dtype: str | None, verify: bool, progress, weights_dtype: str,
          cpu_only: bool = False) -> LoadedModel:
    kind = source_kind(path)
    if experts_dtype == GGML_BANK and kind == "ftw":
        raise InvalidRequestError(f"--experts-dtype {GGML_BANK} keeps a GGUF file's own block types or an NVFP4 "
                                  f"checkpoint's blocks; {path} is an FTW directory: choose one of {', '.join(EXPERT_DTYPES)}")
    if kind == "ftw":
        if experts_dtype is not None:
            index = read_ftw_index(path)
            stored = index.metadata.get("bank", {}).get("dtype")
            if stored != experts_dtype:
                raise InvalidRequestError(
                    f"{path} stores {stored} experts; re-run `moed convert --experts-dtype {experts_dtype}` "
                    "to change the expert format")
        return _load_ftw_model(path, verify, progress)
    checkpoint = open_checkpoint(path)
    _keep_fp8(checkpoint, cpu_only and weights_dtype == "auto")
    bank_dtype = _bank_dtype(checkpoint, kind, experts_dtype, cpu_only)
    if kind in ("gguf", "hf"):  # nothing the file holds changes silently (issue #31)
        for line in checkpoint.type_changes(bank_dtype, packed=weights_dtype == "auto"):
            log.warning("%s: %s", path.name, line)
    if bank_dtype == GGML_BANK:
        bank = checkpoint.ggml_bank(expert_activation(checkpoint.config))
    else:
        bank = stream_expert_bank(checkpoint, bank_dtype)
    wanted = torch.float32 if weights_dtype == "fp32" else None
    weights = {name: _read_run_weight(checkpoint, name, wanted) for name in checkpoint.weight_keys}
    tokenizer_files = checkpoint.tokenizer_files() if kind == "gguf" else None
    return LoadedModel(path, kind, checkpoint.config, weights, bank, tokenizer_files)


def _keep_fp8(checkpoint: Checkpoint, keep: bool) -> None:
    """A Hugging Face checkpoint's block-scaled FP8 linears stay FP8 on a CPU-only load (HfCheckpoint.keep_fp8_linears)."""
    if hasattr(checkpoint, "keep_fp8_linears"):
        checkpoint.keep_fp8_linears(keep)


def _read_run_weight(checkpoint: Checkpoint, name: str, wanted: torch.dtype | None) -> torch.Tensor | PackedLinear:
    """A non-expert weight as the model runs it: a GGUF file's quantised linear() weights and an FP8 checkpoint's
    kept FP8 linears stay packed (PackedLinear, ``packed_weight_dtype``) unless a weights dtype was asked for;
    the rest are tensors."""
    packed = getattr(checkpoint, "packed_weight_dtype", None)
    if wanted is None and packed is not None and packed(name) is not None:
        return checkpoint.read_packed_weight(name)
    return checkpoint.read_weight(name, wanted)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model's config from config.json, the FTW index or the GGUF header, without reading any weights."""
    path = Path(path)
    kind = source_kind(path)
    if kind == "ftw":
        where = str(path / FTW_INDEX)
        config = read_ftw_index(path).metadata.get("config")
        if not isinstance(config, dict):
            raise ModelFormatError(f"{where}: metadata lacks the model config; re-run `moed convert`")
        return parse_model_config(config, where=where)
    if kind == "gguf":
        return open_checkpoint(path).config
    from moed.weights.hf_checkpoint import read_config_json

    return parse_model_config(read_config_json(path), where=str(path / "config.json"))


def expert_activation(config: ModelConfig) -> ExpertActivation:
    moe = config.moe
    return ExpertActivation(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)


def check_bank_dtype(config: ModelConfig, dtype: str) -> None:
    """Refuse a bank dtype the model cannot be stored in, before anything is read."""
    if dtype not in EXPERT_DTYPES:
        raise InvalidRequestError(f"experts dtype {dtype!r} is not one of {', '.join(EXPERT_DTYPES)}")
    if dtype not in ("fp32", "bf16"):  # int4, q8, mxfp4: groups of 32 along K
        for what, k in (("hidden size", config.hidden_size), ("expert intermediate size", config.moe.intermediate_size)):
            if k % INT4_GROUP_SIZE:
                raise InvalidRequestError(f"cannot store experts as {dtype}: the {what} {k} is not a multiple of "
                                          f"{INT4_GROUP_SIZE}; use --experts-dtype bf16 or fp32")


def stream_expert_bank(checkpoint: Checkpoint, dtype: str) -> ExpertBank:
    """The bank, filled a chunk of experts at a time into tensors allocated once at their final size
    (peak: the bank plus one chunk in float32, never the whole pool in float32)."""
    config = checkpoint.config
    check_bank_dtype(config, dtype)
    moe = config.moe
    specs = bank_tensor_specs(dtype, checkpoint.num_bank_rows, config.hidden_size, moe.intermediate_size,
                              moe.has_expert_bias)
    tensors = {name: torch.empty(shape, dtype=tdtype) for name, (shape, tdtype) in specs.items()}
    for chunk in checkpoint.expert_chunks(bank_dtype=dtype):
        rows = bank_rows(chunk, dtype)
        for name, t in rows.items():
            tensors[name][chunk.start : chunk.start + t.shape[0]] = t
    return ExpertBank(num_moe_layers=config.num_moe_layers, num_experts=moe.num_experts,
                      hidden_size=config.hidden_size, intermediate_size=moe.intermediate_size, dtype=dtype,
                      activation=expert_activation(config), tensors=tensors)


def bank_metadata_for(config: ModelConfig, dtype: str) -> dict:
    """The FTW index's description of the bank a model's experts make in ``dtype`` (before it exists)."""
    act = expert_activation(config)
    return {
        "dtype": dtype, "num_moe_layers": config.num_moe_layers, "num_experts": config.moe.num_experts,
        "hidden_size": config.hidden_size, "intermediate_size": config.moe.intermediate_size,
        "activation": {"kind": act.kind, "alpha": act.alpha, "limit": act.limit},
    }


def _load_ftw_model(path: Path, verify: bool, progress) -> LoadedModel:
    index, tensors = load_ftw(path, verify=verify, progress=progress)
    meta = index.metadata
    where = str(path / FTW_INDEX)
    if not isinstance(meta.get("config"), dict) or not isinstance(meta.get("bank"), dict):
        raise ModelFormatError(f"{where}: metadata lacks the model config or the expert-bank description; "
                               "re-run `moed convert`")
    config = parse_model_config(meta["config"], where=where)
    b = meta["bank"]
    try:
        bank = ExpertBank(
            num_moe_layers=int(b["num_moe_layers"]), num_experts=int(b["num_experts"]),
            hidden_size=int(b["hidden_size"]), intermediate_size=int(b["intermediate_size"]), dtype=b["dtype"],
            activation=ExpertActivation(b["activation"]["kind"], float(b["activation"]["alpha"]),
                                        float(b["activation"]["limit"])),
            tensors={name[len(BANK_PREFIX):]: t for name, t in tensors.items() if name.startswith(BANK_PREFIX)},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"{where}: bad expert-bank description ({exc}); re-run `moed convert`") from None
    if (bank.num_moe_layers, bank.num_experts, bank.hidden_size, bank.intermediate_size) != (
            config.num_moe_layers, config.moe.num_experts, config.hidden_size, config.moe.intermediate_size):
        raise ModelFormatError(f"{where}: the expert bank's shape does not match the model config; re-run `moed convert`")
    _check_bank_shapes(bank, where)
    weights = {name: t for name, t in tensors.items() if not name.startswith(BANK_PREFIX)}
    return LoadedModel(path, "ftw", config, weights, bank)


def _check_bank_shapes(bank: ExpertBank, where: str) -> None:
    n, d, i = bank.num_slots, bank.hidden_size, bank.intermediate_size
    g = INT4_GROUP_SIZE
    groups = {"gate_up": (n, d // g, 2 * i), "down": (n, i // g, d)}  # per-group tensors of packed dtypes
    by_dtype = {
        "fp32": {"gate_up": (n, d, 2 * i), "down": (n, i, d)},
        "bf16": {"gate_up": (n, d, 2 * i), "down": (n, i, d)},
        "int4": {"gate_up.q": (n, d, i), "down.q": (n, i, d // 2),
                 **{f"{m}.{p}": shape for m, shape in groups.items() for p in ("scale", "min")}},
        "q8": {"gate_up.qs": (n, d, 2 * i), "down.qs": (n, i, d), **{f"{m}.d": shape for m, shape in groups.items()}},
        "mxfp4": {"gate_up.fp4": (n, d, i), "down.fp4": (n, i, d // 2),
                  **{f"{m}.e8m0": shape for m, shape in groups.items()}},
    }
    expected = by_dtype.get(bank.dtype)
    if expected is None:
        raise ModelFormatError(f"{where}: expert bank dtype {bank.dtype!r} is not one of {', '.join(EXPERT_DTYPES)}; "
                               "re-run `moed convert` with this version")
    for name, shape in expected.items():
        tensor = bank.tensors.get(name)
        if tensor is None or tuple(tensor.shape) != shape:
            got = None if tensor is None else list(tensor.shape)
            raise ModelFormatError(f"{where}: expert bank tensor {name!r} should have shape {list(shape)}, got {got}")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot read JSON ({exc})") from None


def estimate_load(path: str | Path, experts_dtype: str | None = None, weights_dtype: str = "auto",
                  cpu_only: bool = False) -> LoadBytes:
    """Host RAM a load will need at its peak, from file headers only (checked before loading).

    FTW: the tensors as stored (non-expert weights widened when ``weights_dtype`` is fp32).
    Hugging Face / GGUF: non-expert weights in their run-time dtype, the bank in the dtype it will
    have (``cpu_only`` as ``load_model``'s), and the working set of one chunk of experts being converted."""
    path = Path(path)
    kind = source_kind(path)
    if kind != "ftw":
        checkpoint = open_checkpoint(path)
        _keep_fp8(checkpoint, cpu_only and weights_dtype == "auto")
        return checkpoint_load_bytes(checkpoint, _bank_dtype(checkpoint, kind, experts_dtype, cpu_only), weights_dtype)
    index = read_ftw_index(path)
    weights = bank = 0
    for t in index.tensors.values():
        if t.name.startswith(BANK_PREFIX):
            bank += t.size
        else:
            widen = 4 // t.torch_dtype.itemsize if weights_dtype == "fp32" and t.torch_dtype.is_floating_point else 1
            weights += t.size * max(1, widen)
    dtype = index.metadata.get("bank", {}).get("dtype", "?")
    embed = index.tensors.get("model.embed_tokens.weight")
    run_dtype = torch.float32 if weights_dtype == "fp32" else (embed.torch_dtype if embed is not None else None)
    return LoadBytes(weights, bank, 0, dtype, {dtype: bank}, kv_dtype_for(run_dtype))


def estimate_host_bytes(path: str | Path, experts_dtype: str | None = None, weights_dtype: str = "auto") -> int:
    return estimate_load(path, experts_dtype, weights_dtype).total
