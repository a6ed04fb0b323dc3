"""HybridCheckpoints: where a hybrid model's prefill stops to snapshot its recurrent state, and the snapshots.

A hybrid model's linear-attention layers (gated DeltaNet) cannot resume from K/V alone: a cached prefix
is reusable only up to a point where the recurrent state was saved. Prefill chunks therefore stop at
semantic boundaries (``stops``: after end-of-message tokens and ``</think>`` / ``</tool_call>`` /
``</tool_response>`` where the tokenizer has them, and before the prompt's last token, each snapped
down to a whole block); when a sequence reaches one, ``take`` copies the state of its slot into the
prefix tree (KVManager.checkpoint); a newly admitted sequence that resumes from a checkpoint gets it
loaded into its slot before its first step (``restore``). Runs on the engine loop's thread.
"""

from __future__ import annotations

from typing import Iterable

from moed.cache.kv_cache import DEFAULT_BLOCK_SIZE

BOUNDARY_MARKERS = ("</think>", "</tool_call>", "</tool_response>")


def boundary_ids(tokenizer, eos_ids: Iterable[int]) -> frozenset[int]:
    """End-of-message tokens plus the markers the tokenizer has a single token for."""
    markers = set()
    if tokenizer is not None:
        markers = {tokenizer.token_to_id(m) for m in BOUNDARY_MARKERS} - {None}
    return frozenset(set(eos_ids) | markers)


class HybridCheckpoints:
    def __init__(self, kv, scheduler, boundaries: frozenset[int], block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.kv, self.scheduler, self.boundaries, self.block_size = kv, scheduler, boundaries, block_size

    @property
    def enabled(self) -> bool:
        return self.kv.checkpoints

    def stops(self, seq_id: int, token_ids: list[int], cached: int) -> tuple[int, ...]:
        """The scheduler's hook: positions where this prompt's prefill stops (none without checkpoints)."""
        if not self.kv.checkpoints:
            return ()
        bs, last = self.block_size, len(token_ids) - 1
        ends = [i + 1 for i in range(cached, last) if token_ids[i] in self.boundaries] + [last]
        return tuple(sorted({p // bs * bs for p in ends if cached < p // bs * bs <= last}))

    def restore(self, cache, chunks) -> None:
        """Load the checkpoint each newly admitted sequence resumes from into its state slot."""
        for c in chunks:
            saved = self.kv.take_restore(c.seq_id)
            if saved is not None:
                for (layer, name), t in saved.items():
                    cache.state(layer, name)[c.slot].copy_(t)

    def take(self, cache, chunks) -> None:
        """(Under the loop's lock, after the step is recorded) snapshot the state of the sequences whose prefill
        just reached a stop, and keep it in the prefix tree."""
        for c in chunks:
            if c.start + len(c.token_ids) not in self.scheduler.stops_of(c.seq_id):
                continue
            saved = {(layer, name): t[c.slot].clone() for layer, entries in enumerate(cache.states)
                     for name, t in entries.items()}
            nbytes = sum(t.numel() * t.element_size() for t in saved.values())
            self.kv.checkpoint(c.seq_id, self.scheduler.cached_token_ids(c.seq_id), saved, nbytes)
