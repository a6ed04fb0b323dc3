"""A stand-in model whose next token is written in the test: for testing the engine loop, not a model.

`ScriptedModel(scripts)` knows whole token sequences, keyed by their first token: for a sequence
whose position 0 holds `f`, the next token after positions 0..p-1 is `scripts[f][p]` (and `filler`
past the end). A prompt is a prefix of its script, so what a request generates is written in the
test. It records every token fed to every KV slot, so a test can check that the loop feeds back
exactly what it sampled and never writes past the context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moed.engine.runtime import ModelRuntime


@dataclass(frozen=True)
class ScriptedConfig:
    vocab_size: int
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class ScriptedCache:
    num_slots: int
    max_len: int
    fed: list[dict[int, int]] = field(default_factory=list)  # per slot: position -> token fed there

    def __post_init__(self) -> None:
        self.fed = [{} for _ in range(self.num_slots)]


class ScriptedModel:
    def __init__(self, scripts: dict[int, list[int]], *, vocab_size: int, eos_token_ids: tuple[int, ...] = (),
                 filler: int = 0, step_delay_s: float = 0.0) -> None:
        self.config = ScriptedConfig(vocab_size=vocab_size, eos_token_ids=eos_token_ids)
        self.scripts = scripts
        self.filler = filler
        self.step_delay_s = step_delay_s
        self.num_forwards = 0
        self.caches: list[ScriptedCache] = []  # every cache handed out (the loop drops its own on stop)

    def new_cache(self, num_slots: int, max_len: int) -> ScriptedCache:
        cache = ScriptedCache(num_slots, max_len)
        self.caches.append(cache)
        return cache

    def fed(self, slot: int = 0) -> list[int]:
        """Tokens fed to `slot` of the newest cache, by position (0, 1, ...)."""
        fed = self.caches[-1].fed[slot]
        assert sorted(fed) == list(range(len(fed))), "positions were skipped"
        return [fed[i] for i in range(len(fed))]

    def forward(self, batch, cache: ScriptedCache) -> torch.Tensor:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_forwards += 1
        logits = torch.zeros(len(batch.slots), self.config.vocab_size)  # [B, V]
        for row, slot in enumerate(batch.slots):
            start, length = batch.starts[row], batch.lengths[row]
            fed = cache.fed[slot]
            if start == 0:
                fed.clear()  # a reused slot starts over
            for i in range(length):
                assert start + i < cache.max_len, "the loop fed a token past the end of the context"
                fed[start + i] = int(batch.input_ids[row, i])
            nxt = self.next_token(slot, fed, start + length, is_new=start == 0)
            logits[row, nxt] = 100.0  # certain even when the request samples (temperature 1)
        return logits

    def next_token(self, slot: int, fed: dict[int, int], n: int, *, is_new: bool) -> int:
        """The token after positions 0..n-1 of ``slot`` (``fed``: position -> token); ``is_new``: the
        slot started over in this step. Here: the script keyed by the first token, then ``filler``."""
        script = self.scripts[fed[0]]
        return script[n] if n < len(script) else self.filler


def scripted_runtime(model: ScriptedModel, tokenizer=None) -> ModelRuntime:
    return ModelRuntime(loaded=None, model=model, executor=None, tokenizer=tokenizer)
