"""ForwardBatch: one model step for several sequences, each with its own cache slot and offset.

Shapes: R tensor rows of T places, S sequences, L keys visible to the step. Two layouts:

- padded (R = S): each sequence is a row, right-padded to the longest (a decode step, T = 1, and
  chunks of equal length have no padding at all);
- packed (R = 1): the sequences' tokens one after another in a single row, each from its own offset
  (``rows`` / ``offsets``), as vLLM and SGLang flatten a step: a decode row that shares a step with a
  512-token prefill chunk costs one token in the dense layers, not 512.

Token-wise layers (norms, projections, experts, rotary) do not care which; the per-sequence ones
(attention, KV writes, recurrent states, the logits of each sequence's last token) read each
sequence's ``segment``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [R, T] int64
    starts: list[int]  # tokens already in the cache, per sequence
    lengths: list[int]  # valid new tokens, per sequence
    slots: list[int]  # KV-cache slot (a static run of blocks) of each sequence, or its row id with block tables
    block_tables: list[list[int]] | None = None  # KV pool blocks of each sequence (None: the slots' static ones)
    state_slots: list[int] | None = None  # hybrid models: each sequence's recurrent-state slot (None: ``slots``)
    rows: list[int] | None = None  # packed layout: each sequence's tensor row (None: sequence i is row i)
    offsets: list[int] | None = None  # packed layout: each sequence's first place in its row (None: 0)
    positions: torch.Tensor = field(init=False)  # [R, T] absolute positions (padding: past its row's tokens)
    valid: torch.Tensor = field(init=False)  # [R, T] bool, False on padding
    num_keys: int = field(init=False)  # L = longest start + length

    def __post_init__(self) -> None:
        num_rows, steps = self.input_ids.shape
        count = len(self.starts)
        if not (len(self.lengths) == len(self.slots) == count):
            raise ValueError("ForwardBatch: starts, lengths and slots need one entry per sequence")
        if self.block_tables is not None and len(self.block_tables) != count:
            raise ValueError("ForwardBatch: block_tables needs one table per sequence")
        self.packed = self.rows is not None
        if not self.packed:
            if num_rows != count:
                raise ValueError("ForwardBatch: a padded batch has one row per sequence")
            self.rows, self.offsets = list(range(count)), [0] * count
            if any(not 0 <= n <= steps for n in self.lengths):
                raise ValueError(f"ForwardBatch: lengths {self.lengths} do not fit {steps} places")
            places = torch.arange(steps)
            self.positions = torch.tensor(self.starts, dtype=torch.int64)[:, None] + places[None, :]  # [B, T]
            self.valid = places[None, :] < torch.tensor(self.lengths)[:, None]  # [B, T]
        else:
            if self.offsets is None or not (len(self.rows) == len(self.offsets) == count):
                raise ValueError("ForwardBatch: a packed batch needs a row and an offset per sequence")
            self.positions = torch.zeros(num_rows, steps, dtype=torch.int64)
            self.valid = torch.zeros(num_rows, steps, dtype=torch.bool)
            for row, off, start, n in zip(self.rows, self.offsets, self.starts, self.lengths):
                if not (0 <= row < num_rows and 0 <= off and off + n <= steps) or bool(self.valid[row, off:off + n].any()):
                    raise ValueError("ForwardBatch: packed sequences must fit their row and not overlap")
                self.positions[row, off:off + n] = torch.arange(start, start + n)
                self.valid[row, off:off + n] = True
        self.num_keys = max(s + n for s, n in zip(self.starts, self.lengths))
        self.all_valid = sum(self.lengths) == num_rows * steps  # no padding anywhere
        self.memo: dict = {}  # per-step values derived once (the KV cache's pool indices)

    def segment(self, seq: int) -> tuple[int, int, int, int]:
        """Sequence ``seq``'s (tensor row, first place in that row, start position, new tokens)."""
        return self.rows[seq], self.offsets[seq], self.starts[seq], self.lengths[seq]

    def token_sequences(self) -> list[int]:
        """The sequence of each valid place, in row-major order (the order of ``x[valid]``)."""
        steps = self.input_ids.shape[1]
        order = sorted((row * steps + off, seq) for seq, (row, off) in enumerate(zip(self.rows, self.offsets)))
        return [seq for _, seq in order for _ in range(self.lengths[seq])]

    def last_places(self) -> tuple[list[int], list[int]]:
        """(rows, places) of each sequence's last new token (its logits are the step's output)."""
        return list(self.rows), [off + n - 1 for off, n in zip(self.offsets, self.lengths)]

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
                         state_slots: list[int] | None = None, *, packed: bool = False) -> "ForwardBatch":
        """A step from each sequence's new tokens: padded rows, or with ``packed`` (and lengths that differ:
        equal ones have no padding to save) one row of all tokens back to back."""
        lengths = [len(t) for t in tokens]
        if packed and len(set(lengths)) > 1:
            ids = torch.tensor([t for toks in tokens for t in toks], dtype=torch.int64)[None]
            offsets = [sum(lengths[:i]) for i in range(len(lengths))]
            return cls(ids, list(starts), lengths, list(slots), block_tables, state_slots, [0] * len(tokens),
                       offsets)
        steps = max(lengths)
        ids = torch.zeros(len(tokens), steps, dtype=torch.int64)
        for row, toks in enumerate(tokens):
            ids[row, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        return cls(ids, list(starts), lengths, list(slots), block_tables, state_slots)

    def moved(self, to: Callable[[torch.Tensor], torch.Tensor]) -> "ForwardBatch":
        """The same step with its tensors (ids, positions, valid) through ``to``
        (a device's upload); the lists stay on the host. The original is unchanged."""
        out = copy.copy(self)
        out._host_positions, out._host_valid = self.positions, self.valid
        out.input_ids, out.positions, out.valid = to(self.input_ids), to(self.positions), to(self.valid)
        out._to, out.memo = to, {}
        return out
