"""LoadPlan: what a model load will need, worked out from its config before any weight is read.

Options are validated here (context length against the model, batch and queue sizes, expert
dtype, device), so a load that cannot succeed is refused before it spends seconds reading
gigabytes; and the host-RAM check covers the KV cache as well as the weights, saying which
smaller batch or context would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moed.layers.kv_compressor import open_window_floats
from moed.cache.expert_dtypes import LOAD_DTYPES
from moed.cache import q8_0
from moed.cache.kv_cache import DEFAULT_BLOCK_SIZE, KV_TYPES
from moed.devices.select import DEVICE_NAMES, cpu_only
from moed.engine.engine_loop import DEFAULT_MAX_STEP_TOKENS, DEFAULT_PREFILL_CHUNK
from moed.engine.kv_manager import kv_pool_tokens
from moed.engine.runtime import DEFAULT_CONTEXT
from moed.engine.scheduler import SchedulerConfig
from moed.engine.step_workspace import step_workspace_bytes
from moed.errors import InsufficientMemoryError, InvalidRequestError, quoted
from moed.models.moe_transformer import kv_cache_bytes, kv_cache_entries
from moed.service.memory_governor import available_host_bytes, format_bytes
from moed.weights.model_loader import WEIGHT_DTYPES, estimate_load, read_model_config


MIN_EMULATED_B_P = 1e6  # bytes/s; slower emulated links make copies take hours (and timestamps overflow)
MAX_EMULATED_B_P = 1e13


@dataclass(frozen=True)
class LoadPlan:
    context_length: int
    max_batch: int
    weight_bytes: int  # host RAM the weights and expert bank need at the load's peak
    kv_bytes: int  # the KV pool: kv_tokens tokens
    kv_bytes_per_token: int
    kv_tokens: int = 0  # the pool's size in tokens (engine/kv_manager.kv_pool_tokens)
    bank_dtype: str = ""  # the expert bank's dtype this load makes
    bank_bytes: int = 0
    # weight_bytes with the bank in another dtype (empty for FTW: its dtype was fixed at conversion)
    weight_bytes_by_dtype: tuple[tuple[str, int], ...] = ()
    # hybrid models (gated DeltaNet layers): the per-sequence recurrent state of max_batch rows, and the
    # budget of state checkpoints kept for prefix reuse (EngineLoop checkpoint_bytes); 0 for others
    state_bytes: int = 0
    checkpoint_bytes: int = 0
    # MLA models with half-precision weights: the float32 copy of kv_b the absorbed decode keeps per layer
    absorbed_bytes: int = 0
    kv_dtype: torch.dtype = torch.bfloat16  # the K/V pool's (KV_TYPES: int8 is q8_0)
    workspace_bytes: int = 0  # the activations of the largest CPU step (engine/step_workspace.py)

    @property
    def total_bytes(self) -> int:
        return (self.weight_bytes + self.kv_bytes + self.state_bytes + self.checkpoint_bytes + self.absorbed_bytes
                + self.workspace_bytes)


def absorbed_mla_bytes(config, kv_dtype) -> int:
    """The float32 kv_b copy MLA's absorbed decode makes (layers/mla_attention.py), when the weights are not
    float32 already (a float32 model's kv_b is used as it is)."""
    a = config.attention
    if a.kind != "mla" or kv_dtype == torch.float32:
        return 0
    return 4 * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank * config.num_layers


DEFAULT_CHECKPOINT_BYTES = 1 << 30  # a hybrid model's state checkpoints, at most (LRU beyond)


def recurrent_state_bytes(config) -> int:
    """Bytes of one sequence's recurrent state (fp32 conv window + the delta-rule or state-space matrices of each
    linear layer)."""
    if config.attention.kind == "compressed":  # DeepSeek-V4's open compression windows (layers/kv_compressor.py)
        return 4 * sum(open_window_floats(config.attention, r, config.has_indexer(i))
                       for i, r in enumerate(config.compress_ratios))
    d = config.linear_attention
    if d is None or not config.has_recurrent_state:
        return 0
    return 4 * d.state_floats() * sum(config.is_linear(i) for i in range(config.num_layers))


KV_SHARE_OF_FREE_RAM = 0.5  # an automatic context's KV pool takes at most this share of the RAM the weights leave


def auto_context(max_pos: int, kv_bytes_per_token: int, weight_bytes: int, available_bytes: int, max_batch: int,
                 kv_tokens: int | None = None, other_bytes: int = 0) -> int:
    """The context a load gets when none is asked for: the largest the model supports
    (``max_position_embeddings``) whose KV pool (``kv_pool_tokens``: two whole contexts, or ``max_batch``
    when that is fewer; ``kv_tokens`` when given) fits in KV_SHARE_OF_FREE_RAM of the host RAM left after
    the weights (and ``other_bytes``: a hybrid model's states and checkpoints), in whole KV blocks; never
    below DEFAULT_CONTEXT (a load that cannot hold even that fails with the memory error naming what would
    fit)."""
    floor = min(DEFAULT_CONTEXT, max_pos)
    room = int((available_bytes - weight_bytes - other_bytes) * KV_SHARE_OF_FREE_RAM)
    if kv_tokens is not None:
        fits = kv_tokens  # the pool is given: a context may be as long as the pool
    else:
        fits = room // max(1, kv_bytes_per_token) // min(max_batch, 2) if room > 0 else 0
    fits = fits // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
    return max(floor, min(max_pos, fits))


def plan_load(path: Path, options, *, available_bytes: int | None = None) -> LoadPlan:
    """Validate ``options`` (a LoadOptions) against the model at ``path``; raises InvalidRequestError.

    Without ``options.context_length`` the context is ``auto_context``'s, for ``available_bytes`` of
    host RAM (default: what is available now)."""
    config = read_model_config(path)
    max_pos = config.max_position_embeddings
    context = options.context_length
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 2):
        raise InvalidRequestError(f"context_length must be an integer of at least 2 tokens, got {quoted(context)}")
    if context is not None and context > max_pos:
        raise InvalidRequestError(
            f"context_length {context} exceeds the model's max_position_embeddings ({max_pos}); use at most {max_pos}")
    # the engine loop's own limits, checked now rather than after the weights are read
    SchedulerConfig(options.max_batch, options.max_queue, DEFAULT_PREFILL_CHUNK, DEFAULT_MAX_STEP_TOKENS)
    if options.experts_dtype is not None and options.experts_dtype not in LOAD_DTYPES:
        raise InvalidRequestError(f"experts_dtype {quoted(options.experts_dtype)}: choose one of {', '.join(LOAD_DTYPES)}")
    if options.weights_dtype not in WEIGHT_DTYPES:
        raise InvalidRequestError(f"weights_dtype {quoted(options.weights_dtype)}: choose {' or '.join(WEIGHT_DTYPES)}")
    device = str(options.device or "auto").strip().lower()
    if device not in DEVICE_NAMES:
        raise InvalidRequestError(f"unknown device {quoted(options.device)}: choose one of {', '.join(DEVICE_NAMES)}")
    b_p = options.emulated_b_p
    if not (MIN_EMULATED_B_P <= b_p <= MAX_EMULATED_B_P):  # NaN fails both comparisons
        raise InvalidRequestError(f"emulated_b_p {b_p!r} bytes/s is out of range: give a value between "
                                  f"{MIN_EMULATED_B_P:.0e} and {MAX_EMULATED_B_P:.0e}")
    kv_type = getattr(options, "kv_type", None)
    if kv_type is not None and kv_type not in KV_TYPES:
        raise InvalidRequestError(f"kv_type {quoted(kv_type)}: choose one of {', '.join(KV_TYPES)}")
    est = estimate_load(path, options.experts_dtype, options.weights_dtype, cpu_only=cpu_only(device))
    if kv_type is not None:
        est = replace(est, kv_dtype=KV_TYPES[kv_type])
        if kv_type == "q8_0":
            for name, shape in kv_cache_entries(config).items():
                try:
                    q8_0.check_row_size(name, shape[-1])
                except ValueError as exc:
                    raise InvalidRequestError(str(exc)) from None
    per_token = kv_cache_bytes(config, 1, 1, est.kv_dtype) // DEFAULT_BLOCK_SIZE
    state_bytes = recurrent_state_bytes(config) * options.max_batch
    checkpoint_bytes = 0
    if state_bytes and options.prefix_cache:
        checkpoint_bytes = DEFAULT_CHECKPOINT_BYTES if options.checkpoint_bytes is None else options.checkpoint_bytes
        if isinstance(checkpoint_bytes, bool) or not isinstance(checkpoint_bytes, int) or checkpoint_bytes < 0:
            raise InvalidRequestError(f"checkpoint_bytes must be a number of bytes >= 0, got {quoted(checkpoint_bytes)}")
    workspace = step_workspace_bytes(config, DEFAULT_MAX_STEP_TOKENS, sequences=options.max_batch)  # a CPU step
    if context is None:
        available = available_host_bytes() if available_bytes is None else int(available_bytes)
        context = auto_context(max_pos, per_token, est.total, available, options.max_batch, options.kv_tokens,
                               other_bytes=state_bytes + checkpoint_bytes + absorbed_mla_bytes(config, est.kv_dtype)
                               + workspace)
    kv_tokens = kv_pool_tokens(context, options.max_batch, options.kv_tokens)
    others = tuple((dtype, est.total - est.bank_bytes + nbytes) for dtype, nbytes in est.bank_bytes_by_dtype.items()
                   if dtype != est.bank_dtype)
    return LoadPlan(context_length=context, max_batch=options.max_batch, weight_bytes=est.total,
                    kv_bytes=per_token * kv_tokens, kv_bytes_per_token=per_token, kv_tokens=kv_tokens,
                    bank_dtype=est.bank_dtype, bank_bytes=est.bank_bytes, weight_bytes_by_dtype=others,
                    state_bytes=state_bytes, checkpoint_bytes=checkpoint_bytes,
                    absorbed_bytes=absorbed_mla_bytes(config, est.kv_dtype), kv_dtype=est.kv_dtype,
                    workspace_bytes=workspace)


def check_load_fits(plan: LoadPlan, *, available_bytes: int | None = None, what: str = "the model") -> None:
    """Raise InsufficientMemoryError when weights + KV pool exceed the host RAM available now,
    naming a KV pool size, a context length or an expert dtype that would fit."""
    available = available_host_bytes() if available_bytes is None else int(available_bytes)
    if plan.total_bytes <= available:
        return
    states = (f" + {format_bytes(plan.state_bytes + plan.checkpoint_bytes)} of recurrent states and state "
              f"checkpoints" if plan.state_bytes else "")
    need = (f"{what} needs {format_bytes(plan.total_bytes)} of host RAM ({format_bytes(plan.weight_bytes)} of weights "
            f"+ {format_bytes(plan.kv_bytes)} of KV pool for {plan.kv_tokens} tokens, context "
            f"{plan.context_length}{states} + {format_bytes(plan.workspace_bytes)} of step activations) but "
            f"{format_bytes(available)} are available")
    room = (available - plan.weight_bytes - plan.state_bytes - plan.checkpoint_bytes - plan.absorbed_bytes
            - plan.workspace_bytes)
    tokens = room // plan.kv_bytes_per_token if room > 0 and plan.kv_bytes_per_token > 0 else 0
    hints = []
    pool = tokens // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE  # whole blocks
    if pool >= plan.context_length:
        hints.append(f"kv_tokens {pool} (a smaller KV pool: fewer long sequences at once)")
    elif pool >= 2:
        hints.append(f"context {pool} with kv_tokens {pool}")
    # the largest expert dtype (fewest bits lost) that fits with the requested batch and context
    smaller = sorted(((nbytes, dtype) for dtype, nbytes in plan.weight_bytes_by_dtype
                      if nbytes < plan.weight_bytes and nbytes + plan.kv_bytes <= available), reverse=True)
    if smaller:
        hints.append(f"--experts-dtype {smaller[0][1]} ({format_bytes(smaller[0][0] + plan.kv_bytes)} in all)")
    if hints:
        raise InsufficientMemoryError(f"{need}; would fit: {' or '.join(hints)}")
    smallest = min(plan.weight_bytes_by_dtype, key=lambda item: item[1], default=None)
    if smallest is not None and smallest[1] < plan.weight_bytes:
        raise InsufficientMemoryError(f"{need}; even --experts-dtype {smallest[0]} needs "
                                      f"{format_bytes(smallest[1] + plan.kv_bytes)}: close other programs "
                                      "or use a machine with more RAM")
    raise InsufficientMemoryError(f"{need}; close other programs or convert with a smaller expert dtype "
                                  "(moed convert --experts-dtype int4)")
