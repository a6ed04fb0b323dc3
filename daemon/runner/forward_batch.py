"""ForwardBatch: one model step for several sequences, each with its own cache slot and offset.

Shapes: B sequences, T new tokens (right-padded to the longest), L keys visible to the step.
A prefill of prompts with different lengths and a decode step (T = 1) are the same thing here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded
    starts: list[int]  # tokens already in the cache, per sequence
    lengths: list[int]  # valid new tokens, per sequence (<= T)
    slots: list[int]  # KV-cache slot (a static run of blocks) of each sequence, or its row id with block tables
    block_tables: list[list[int]] | None = None  # KV pool blocks of each sequence (None: the slots' static ones)
    state_slots: list[int] | None = None  # hybrid models: each sequence's recurrent-state slot (None: ``slots``)
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
        self.memo: dict = {}  # per-step values derived once (the KV cache's pool indices)
        if self.block_tables is not None and len(self.block_tables) != batch:
            raise ValueError("ForwardBatch: block_tables needs one table per sequence")

    @property
    def host_positions(self) -> torch.Tensor:
        return getattr(self, "_host_positions", self.positions)

    @property
    def host_valid(self) -> torch.Tensor:
        return getattr(self, "_host_valid", self.valid)

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor made for this step, on the step's device (as is for a batch that was not moved)."""
        to = getattr(self, "_to", None)
        return t if to is None else to(t)

    @classmethod
    def from_token_lists(cls, tokens: list[list[int]], starts: list[int], slots: list[int],
                         block_tables: list[list[int]] | None = None,
                         state_slots: list[int] | None = None) -> "ForwardBatch":
        steps = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), steps, dtype=torch.int64)
        for row, toks in enumerate(tokens):
            ids[row, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        return cls(ids, list(starts), [len(t) for t in tokens], list(slots), block_tables, state_slots)

    def moved(self, to: Callable[[torch.Tensor], torch.Tensor]) -> "ForwardBatch":
        """The same step with its tensors (ids, positions, valid) through ``to``
        (a device's upload); the lists stay on the host. The original is unchanged."""
        out = copy.copy(self)
        out._host_positions, out._host_valid = self.positions, self.valid
        out.input_ids, out.positions, out.valid = to(self.input_ids), to(self.positions), to(self.valid)
        out._to, out.memo = to, {}
        return out
