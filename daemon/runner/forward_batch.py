"""ForwardBatch: one model step for several sequences, each with its own cache slot and offset.

Shapes: B sequences, T new tokens (right-padded to the longest), L keys visible to the step.
A prefill of prompts with different lengths and a decode step (T = 1) are the same thing here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    starts: list[int]  # tokens already in the cache, per sequence
    lengths: list[int]  # valid new tokens, per sequence (<= T)
    slots: list[int]  # KV-cache slot of each sequence
    positions: torch.Tensor = field(init=False)  # [B, T] absolute positions
    valid: torch.Tensor = field(init=False)  # [B, T] bool, False on padding
    num_keys: int = field(init=False)  # L = longest start + length

    def __post_init__(self) -> None:
        batch, steps = self.input_ids.shape
        if not (len(self.starts) == len(self.lengths) == len(self.slots) == batch):
            raise ValueError("ForwardBatch: starts, lengths and slots need one entry per sequence")
        offsets = torch.arange(steps)
        starts = torch.tensor(self.starts, dtype=torch.int64)
        self.positions = starts[:, None] + offsets[None, :]  # [B, T]
        self.valid = offsets[None, :] < torch.tensor(self.lengths)[:, None]  # [B, T]
        self.num_keys = max(s + n for s, n in zip(self.starts, self.lengths))
        self._masks: dict[int | None, torch.Tensor] = {}

    @classmethod
    def from_token_lists(cls, tokens: list[list[int]], starts: list[int], slots: list[int]) -> "ForwardBatch":
        steps = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), steps, dtype=torch.int64)
        for row, toks in enumerate(tokens):
            ids[row, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        return cls(ids, list(starts), [len(t) for t in tokens], list(slots))

    def attention_mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, T, L] bool: key j is visible to query t iff j <= pos(t) and, with a window w, j > pos(t) - w."""
        if window not in self._masks:
            keys = torch.arange(self.num_keys)[None, None, :]  # [1, 1, L]
            query_pos = self.positions[:, :, None]  # [B, T, 1]
            mask = keys <= query_pos
            if window is not None:
                mask &= keys > query_pos - window
            self._masks[window] = mask[:, None]
        return self._masks[window]
