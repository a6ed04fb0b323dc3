"""KVCache: per-layer key/value (or MLA latent) storage for a fixed number of sequence slots.

Entries are token-major, ``[slots, max_len, ...]``, so a step writes each sequence's new tokens
with one slice assignment and reads the first L tokens of the slots in the batch.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layer_entries: list[dict[str, tuple[int, ...]]], num_slots: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> None:
        """``layer_entries[i]`` maps an entry name ("k", "v", "latent", ...) to its per-token shape."""
        self.num_slots = num_slots
        self.max_len = max_len
        self.layers = [
            {name: torch.zeros(num_slots, max_len, *shape, dtype=dtype, device=device) for name, shape in entries.items()}
            for entries in layer_entries
        ]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for entries in self.layers for t in entries.values())

    def entry(self, layer: int, name: str) -> torch.Tensor:
        """The whole ``[slots, max_len, ...]`` store of one entry (kernels that write and read in place)."""
        return self.layers[layer][name]

    def write(self, layer: int, name: str, values: torch.Tensor, slots: list[int], starts: list[int],
              lengths: list[int]) -> None:
        """values [B, T, ...]: store the first ``lengths[b]`` tokens of row b at ``starts[b]`` of its slot."""
        store = self.layers[layer][name]
        for row, (slot, start, length) in enumerate(zip(slots, starts, lengths)):
            if start + length > self.max_len:
                raise ValueError(f"KV cache slot {slot} holds {self.max_len} tokens; {start + length} needed")
            store[slot, start : start + length] = values[row, :length]

    def read(self, layer: int, name: str, slots: list[int], num_keys: int) -> torch.Tensor:
        """[B, L, ...] for the given slots (positions past a sequence's length are masked by the caller)."""
        store = self.layers[layer][name]
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return store[slots[0] : slots[0] + len(slots), :num_keys]
        return store[slots, :num_keys]
