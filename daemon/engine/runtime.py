"""ModelRuntime: one loaded model ready to generate (weights, expert bank, executor, tokenizer)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moed.errors import InvalidRequestError
from moed.config import EngineConfig
from moed.devices.select import cpu_only
from moed.experts.executor_factory import build_executor
from moed.models.families import FAMILIES
from moed.models.moe_transformer import MoeTransformer, device_mode_blocker
from moed.text.builtin_templates import builtin_template
from moed.text.tiktoken_vocab import TIKTOKEN_FILE
from moed.text.tokenizer import Tokenizer
from moed.weights.model_loader import LoadedModel, load_model

DEFAULT_CONTEXT = 4096

log = logging.getLogger(__name__)


@dataclass
class ModelRuntime:
    loaded: LoadedModel
    model: MoeTransformer
    executor: object  # CpuExecutor or HybridExecutor (both: run, stats, close)
    tokenizer: Tokenizer | None

    def close(self) -> None:
        self.executor.close()

    @property
    def tool_format(self) -> str:
        """How the model's answers write tool calls and reasoning (its family's; moed.text.output_parser)."""
        family = FAMILIES.get(self.model.config.family)
        return family.tool_format if family is not None else "plain"

    def encode_prompt(self, prompt: str, *, chat: bool, system: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.loaded.path} has no tokenizer.json; text prompts need one")
        if not chat:
            return self.tokenizer.encode(prompt)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template already wrote any BOS it wants; don't add another
        return self.tokenizer.encode(text, add_special_tokens=False)


def compile_expert_kernels(bank) -> None:
    """Compile (or load from numba's cache) the CPU expert kernels now, at load time, so the first
    request does not pay seconds of JIT. This touches no cache state: it is not a warm-up phase."""
    import torch

    from moed.experts.expert_ffn import run_expert

    for tokens in (1, 17):  # the decode kernel and the many-token (prefill) path
        run_expert(bank, 0, torch.zeros(tokens, bank.hidden_size))


def model_device(executor, engine: EngineConfig, weights: dict):
    """The device the non-expert model runs on (None: the host), and why not when it cannot."""
    device = getattr(executor, "device", None)
    if device is None or device.kind == "cpu" or not engine.model_on_device:
        return None
    blocker = device_mode_blocker(weights)
    if blocker is not None:
        executor.stats.model_note = blocker
        return None
    return device


def _tokenizer_of(loaded: LoadedModel) -> Tokenizer | None:
    """A directory's tokenizer.json (or tiktoken.model), or the one a GGUF file's metadata describes; None without. A
    tokenizer without a chat template gets moed's template of the family where it has one (DeepSeek-V3.2)."""
    if loaded.tokenizer_files is not None:
        tokenizer = Tokenizer.from_files(loaded.tokenizer_files, where=str(loaded.path))
    elif (Path(loaded.path) / "tokenizer.json").is_file() or (Path(loaded.path) / TIKTOKEN_FILE).is_file():
        tokenizer = Tokenizer(loaded.path)  # tokenizer.json, or Kimi's tiktoken vocabulary
    else:
        return None
    family = FAMILIES.get(loaded.config.family)
    builtin = builtin_template(family.chat_template) if family is not None and family.chat_template else None
    if tokenizer.chat_template is None and builtin is not None:
        tokenizer.adopt_chat_template(*builtin)
        log.info("%s: no chat template in the checkpoint; using %s", loaded.path, builtin[1])
    return tokenizer


def open_runtime(path: str | Path, *, experts_dtype: str | None = None, verify: bool = False,
                 progress: Callable[[int, int], None] | None = None, engine: EngineConfig | None = None,
                 trace_out: str | Path | None = None, weights_dtype: str = "auto") -> ModelRuntime:
    engine = engine or EngineConfig(device="cpu")
    loaded = load_model(path, experts_dtype=experts_dtype, verify=verify, progress=progress,
                        weights_dtype=weights_dtype, cpu_only=cpu_only(engine.device))
    compile_expert_kernels(loaded.bank)
    executor = build_executor(loaded.bank, engine, trace_out=trace_out)
    device = model_device(executor, engine, loaded.weights)
    if loaded.config.attention.kind == "compressed":  # DeepSeek-V4: its own model, on the host
        from moed.models.deepseek_v4 import DeepseekV4Transformer

        device = None
        model = DeepseekV4Transformer(loaded.config, loaded.weights, executor, where=str(loaded.path))
    else:
        model = MoeTransformer(loaded.config, loaded.weights, executor, where=str(loaded.path), device=device)
    if device is not None:
        executor.model_on_device = True  # hidden states, routing and results stay on the device
        # the host copies go: on a GPU the weights now live in VRAM, and host RAM would hold them twice
        loaded.weights = model.weights
    tokenizer = _tokenizer_of(loaded)
    return ModelRuntime(loaded, model, executor, tokenizer)
