"""A stand-in model whose next token is written in the test: for testing the engine loop, not a model.

`ScriptedModel(scripts)` knows whole token sequences, keyed by their first token: for a sequence
whose position 0 holds `f`, the next token after positions 0..p-1 is `scripts[f][p]` (and `filler`
past the end). A prompt is a prefix of its script, so what a request generates is written in the
test. Its KV pool holds the token ids fed, read back through each step's block tables, so a test
can check that the loop feeds back exactly what it sampled, that a reused prefix holds the right
tokens, and that nothing is written past a sequence's blocks.
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
    """A paged KV pool holding token ids instead of keys and values: what a sequence "attends to" is read
    back through its block table, so a wrong table or a reused block with other contents shows up as
    the wrong next token."""

    num_blocks: int
    block_size: int
    num_slots: int = 0  # a for-slots cache (new_cache): slot s owns a fixed run of blocks
    rows: dict[int, int] = field(default_factory=dict)  # pool row -> token written there
    fed: dict[int, dict[int, int]] = field(default_factory=dict)  # per sequence: position -> token it sees

    def table(self, batch, row: int) -> list[int]:
        if batch.block_tables is not None:
            return batch.block_tables[row]
        per_slot = self.num_blocks // self.num_slots
        slot = batch.slots[row]
        return list(range(slot * per_slot, (slot + 1) * per_slot))


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
        cache = ScriptedCache(num_slots * -(-max_len // 16), 16, num_slots)
        self.caches.append(cache)
        return cache

    def new_pool(self, num_blocks: int, block_size: int) -> ScriptedCache:
        cache = ScriptedCache(num_blocks, block_size)
        self.caches.append(cache)
        return cache

    def fed(self, seq: int = 0) -> list[int]:
        """Tokens sequence ``seq`` (the engine's seq id: 0, 1, ... in submission order) saw in the newest
        cache, by position (0, 1, ...)."""
        fed = self.caches[-1].fed[seq]
        assert sorted(fed) == list(range(len(fed))), "positions were skipped"
        return [fed[i] for i in range(len(fed))]

    def forward(self, batch, cache: ScriptedCache) -> torch.Tensor:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.num_forwards += 1
        logits = torch.zeros(len(batch.slots), self.config.vocab_size)  # [B, V]
        bs = cache.block_size
        for row, seq in enumerate(batch.slots):  # row: the sequence's index in the step (packed or padded)
            tensor_row, offset, start, length = batch.segment(row)
            table = cache.table(batch, row)
            assert start + length <= len(table) * bs, "the loop fed a token past the blocks of its sequence"
            for i in range(length):
                p = start + i
                cache.rows[table[p // bs] * bs + p % bs] = int(batch.input_ids[tensor_row, offset + i])
            is_new = seq not in cache.fed or start == 0  # (a for-slots cache reuses its slots from 0)
            cache.fed[seq] = {p: cache.rows[table[p // bs] * bs + p % bs] for p in range(start + length)}
            nxt = self.next_token(seq, cache.fed[seq], start + length, is_new=is_new)
            logits[row, nxt] = 100.0  # certain even when the request samples (temperature 1)
        return logits

    def next_token(self, seq: int, fed: dict[int, int], n: int, *, is_new: bool) -> int:
        """The token after positions 0..n-1 of sequence ``seq`` (``fed``: position -> token, read back
        from the pool); ``is_new``: its first step. Here: the script keyed by the first token, then ``filler``."""
        script = self.scripts[fed[0]]
        return script[n] if n < len(script) else self.filler


def scripted_runtime(model: ScriptedModel, tokenizer=None) -> ModelRuntime:
    return ModelRuntime(loaded=None, model=model, executor=None, tokenizer=tokenizer)
