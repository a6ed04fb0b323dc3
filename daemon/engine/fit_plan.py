"""`moed fit`: what a model needs and where it would run, on machines of given RAM and VRAM, from its config.

A model path is planned the way a load plans it (``load_plan``: the expert bank in the dtype the load would
choose, the non-expert weights in their run-time dtype, the KV pool, a step's activations); a directory
with only config.json (or a config.json file) is planned from the tensors the config implies
(``weights/config_only.py``), so the plan for a 750 GB checkpoint needs no download. Each machine gets:

- with a GPU that holds the non-expert weights, one step's activations and a 4096-token KV pool, the model
  lives there (as ``model_on_device`` does): its KV pool gets half of what the weights leave (up to the
  model's longest context) and the expert cache the rest; the host keeps the expert bank;
- otherwise everything but the expert cache is on the host (the GPU, if any, caches experts only) and the
  context is ``auto_context``'s; so too for a GGUF file whose quantised linears stay packed (the device
  path multiplies plain tensors only);
- the host must hold the load's peak (the bank, the weights before they move, a conversion chunk) and,
  after it, what stays, within the RAM a desktop leaves a model (``HOST_RESERVE``); a machine that cannot
  is refused with the reason, and the largest expert dtype that would fit is named.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from moed.cache.expert_dtypes import EXPERT_DTYPES
from moed.cache.kv_cache import DEFAULT_BLOCK_SIZE
from moed.engine.engine_loop import DEFAULT_MAX_STEP_TOKENS
from moed.engine.load_plan import (DEFAULT_CHECKPOINT_BYTES, absorbed_mla_bytes, auto_context,
                                   recurrent_state_bytes)
from moed.engine.runtime import DEFAULT_CONTEXT
from moed.engine.step_workspace import step_workspace_bytes
from moed.errors import ModelFormatError
from moed.models.moe_transformer import kv_cache_bytes
from moed.models.weight_spec import expected_weight_shapes
from moed.service.memory_governor import GovernorConfig, format_bytes
from moed.weights.checkpoint import LoadBytes, checkpoint_load_bytes, open_checkpoint, source_kind
from moed.weights.config_only import ConfigOnlyCheckpoint
from moed.weights.model_loader import _bank_dtype, estimate_load, read_model_config

GB = 10**9
DEFAULT_RAM_GB = (24, 64, 128)
DEFAULT_VRAM_GB = (0, 8, 16, 32)


def host_reserve(ram_bytes: int) -> int:
    """RAM a desktop keeps for the OS, the browser and the rest: 10%, at least 3 GB."""
    return max(3 * GB, ram_bytes // 10)


@dataclass(frozen=True)
class ModelNeeds:
    """What a model needs, whatever the machine."""

    family: str
    num_layers: int
    num_experts: int
    top_k: int
    total_params: int
    active_params: int
    load: LoadBytes  # the default bank's bytes, the non-expert weights', the load's working set
    kv_bytes_per_token: int
    max_context: int
    host_step_bytes: int  # one CPU step's activations (and MLA's float32 kv_b, a hybrid model's states)
    device_step_bytes: int  # one device step's activations
    source: str  # "config.json alone" or "the checkpoint's headers"
    packed_weights: bool = False  # a GGUF's quantised linears stay packed: the model itself stays on the host


@dataclass(frozen=True)
class MachineFit:
    ram_bytes: int
    vram_bytes: int
    runs: bool
    where: str  # "gpu" (weights and KV on the GPU, experts cached there), "cpu+gpu cache", "cpu"; or the reason
    context: int = 0
    kv_bytes: int = 0
    expert_cache_bytes: int = 0
    host_bytes: int = 0  # the host's peak (the load's)
    hint: str = ""  # a smaller expert dtype that would fit, when the default does not


def model_needs(path: str | Path, experts_dtype: str | None = None, *, cpu_only: bool = True) -> ModelNeeds:
    """``cpu_only``: plan the bank a CPU-only machine's load makes (a GGUF file's, or an NVFP4, FP8 or MXFP8 checkpoint's blocks
    kept as stored), else the one a machine with a GPU gets."""
    path = Path(path)
    config_file = path if path.is_file() and path.suffix == ".json" else None
    only_config = config_file is not None or (path.is_dir() and _has_no_weights(path))
    packed = False
    if only_config:
        where = config_file or path / "config.json"
        try:
            raw = json.loads(Path(where).read_text())
        except (OSError, ValueError) as exc:
            raise ModelFormatError(f"{where}: cannot read the model config ({exc})") from None
        checkpoint = ConfigOnlyCheckpoint(raw, where=str(where), path=Path(where).parent)
        checkpoint.keep_fp8_linears(cpu_only)
        load = checkpoint_load_bytes(checkpoint, _bank_dtype(checkpoint, "hf", experts_dtype, cpu_only))
        config = checkpoint.config
        source = "config.json alone"
    else:
        kind = source_kind(path)  # a clear error for a path that is no model
        config = read_model_config(path)
        load = estimate_load(path, experts_dtype, cpu_only=cpu_only)
        source = "the checkpoint's headers"
        if kind == "gguf":  # quantised attention / dense weights load packed (device_mode_blocker)
            checkpoint = open_checkpoint(path)
            packed = any(checkpoint.packed_weight_dtype(name) for name in checkpoint.weight_shapes())
    moe = config.moe
    # an expert's parameters: gate, up, down; Nemotron-H's relu^2 experts have no gate (the bank stores up twice, which
    # the bank's bytes count, not its parameters)
    expert = (2 if moe.activation == "relu2" else 3) * config.hidden_size * moe.intermediate_size
    non_expert = sum(math.prod(s) for s in expected_weight_shapes(config).values())
    lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size  # the input table is read, not multiplied
    active = non_expert - lookup + config.num_moe_layers * moe.top_k * expert
    per_token = kv_cache_bytes(config, 1, 1, load.kv_dtype) // DEFAULT_BLOCK_SIZE
    states = recurrent_state_bytes(config)
    host_step = (step_workspace_bytes(config, DEFAULT_MAX_STEP_TOKENS) + absorbed_mla_bytes(config, load.kv_dtype)
                 + states + (DEFAULT_CHECKPOINT_BYTES if states else 0))
    device_step = step_workspace_bytes(config, DEFAULT_MAX_STEP_TOKENS, device_type="cuda") + states
    return ModelNeeds(config.family, config.num_layers, moe.num_experts, moe.top_k,
                      non_expert + config.num_moe_layers * moe.num_experts * expert, active, load, per_token,
                      config.max_position_embeddings, host_step, device_step, source, packed)


def _has_no_weights(path: Path) -> bool:
    return (path / "config.json").is_file() and not any(path.glob("*.safetensors")) and not (path / "ftw.json").exists()


def fit_machine(needs: ModelNeeds, ram_bytes: int, vram_bytes: int, *, by_dtype: bool = True) -> MachineFit:
    load = needs.load
    host = ram_bytes - host_reserve(ram_bytes)
    vram = vram_bytes - GovernorConfig().headroom(vram_bytes) if vram_bytes else 0
    floor = min(DEFAULT_CONTEXT, needs.max_context)
    fit = None
    if vram and not needs.packed_weights \
            and load.weight_bytes + needs.device_step_bytes + floor * needs.kv_bytes_per_token <= vram:
        # the model on the GPU: its KV gets half of what the weights leave, the expert cache the rest
        room = vram - load.weight_bytes - needs.device_step_bytes
        tokens = room // 2 // max(1, needs.kv_bytes_per_token) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
        context = max(floor, min(needs.max_context, tokens))
        kv = context * needs.kv_bytes_per_token
        steady = load.bank_bytes + needs.host_step_bytes
        if max(load.total, steady) <= host:
            fit = MachineFit(ram_bytes, vram_bytes, True, "gpu", context, kv, room - kv, load.total)
    if fit is None:
        others = needs.host_step_bytes
        context = auto_context(needs.max_context, needs.kv_bytes_per_token, load.total, host, 1, other_bytes=others)
        kv = context * needs.kv_bytes_per_token
        total = load.total + kv + others
        cache = max(0, vram - needs.device_step_bytes) if vram else 0
        if total <= host:
            fit = MachineFit(ram_bytes, vram_bytes, True, "cpu+gpu cache" if cache else "cpu", context, kv, cache,
                             total)
        else:
            reason = (f"needs {format_bytes(total)} of RAM with the bank as {load.bank_dtype}; "
                      f"{format_bytes(host)} of {ram_bytes / GB:.0f} GB are left to a model")
            fit = MachineFit(ram_bytes, vram_bytes, False, reason, host_bytes=total)
    if fit.runs or not by_dtype:
        return fit
    for dtype in _smaller_dtypes(load):
        smaller = fit_machine(_with_bank(needs, dtype), ram_bytes, vram_bytes, by_dtype=False)
        if smaller.runs:
            return MachineFit(**{**fit.__dict__, "hint": f"fits with --experts-dtype {dtype} "
                                                          f"({format_bytes(load.bank_bytes_by_dtype[dtype])} bank)"})
    return fit


def _smaller_dtypes(load: LoadBytes) -> list[str]:
    """Bank dtypes smaller than the load's, largest first (fewest bits lost first)."""
    sizes = load.bank_bytes_by_dtype
    return sorted((d for d in sizes if d in EXPERT_DTYPES and sizes[d] < load.bank_bytes), key=lambda d: -sizes[d])


def _with_bank(needs: ModelNeeds, dtype: str) -> ModelNeeds:
    load = needs.load
    other = LoadBytes(load.weight_bytes, load.bank_bytes_by_dtype[dtype], load.working_bytes, dtype,
                      load.bank_bytes_by_dtype, load.kv_dtype)
    return ModelNeeds(**{**needs.__dict__, "load": other})


def format_report(needs: ModelNeeds, fits: list[MachineFit]) -> str:
    load = needs.load
    lines = [
        f"{needs.family}: {needs.num_layers} layers, {needs.num_experts} experts (top {needs.top_k}), "
        f"{needs.total_params / 1e9:.1f} B parameters, {needs.active_params / 1e9:.1f} B active per token "
        f"(from {needs.source})",
        f"  expert bank: {format_bytes(load.bank_bytes)} as {load.bank_dtype} (host RAM)"
        + "".join(f"; {d} {format_bytes(n)}" for d, n in sorted(load.bank_bytes_by_dtype.items(), key=lambda i: -i[1])
                  if d != load.bank_dtype),
        f"  other weights: {format_bytes(load.weight_bytes)} (on the GPU when it holds them, else host RAM)",
        f"  KV cache: {needs.kv_bytes_per_token / 1024:.1f} KiB per token; {needs.max_context} tokens (the "
        f"model's longest context) take {format_bytes(needs.kv_bytes_per_token * needs.max_context)}",
        f"  one step's activations: {format_bytes(needs.host_step_bytes)} on the CPU, "
        f"{format_bytes(needs.device_step_bytes)} on a GPU",
        "",
        f"{'RAM':>6} {'VRAM':>6}  {'runs':<4}  {'where':<14} {'context':>8} {'KV':>8} {'expert cache':>13}  notes",
    ]
    for f in fits:
        vram = f"{f.vram_bytes / GB:.0f} GB" if f.vram_bytes else "-"
        if f.runs:
            cache = f"{format_bytes(f.expert_cache_bytes)}" if f.expert_cache_bytes else "-"
            lines.append(f"{f.ram_bytes / GB:>3.0f} GB {vram:>6}  yes   {f.where:<14} {f.context:>8} "
                         f"{format_bytes(f.kv_bytes):>8} {cache:>13}")
        else:
            lines.append(f"{f.ram_bytes / GB:>3.0f} GB {vram:>6}  no    {f.where}" + (f"; {f.hint}" if f.hint else ""))
    return "\n".join(lines)


__all__ = ["MachineFit", "ModelNeeds", "fit_machine", "format_report", "host_reserve", "model_needs"]
