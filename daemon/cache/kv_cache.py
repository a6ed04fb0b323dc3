"""KVCache: a paged pool of per-layer key/value (or MLA latent) storage, addressed through block tables.

Each entry of each layer is one tensor ``[num_blocks, block_size, ...]`` in the cache's dtype (the
model's: bfloat16 for bf16/fp16 checkpoints, float32 for fp32 ones or ``--weights-dtype fp32``; or
``--kv-type``'s). With int8 the pool holds q8_0 blocks (cache/q8_0.py): each entry has a float16
scale per 32 values beside it (``name + "_scale"``); writes quantise, reads widen.
Token ``j`` of a sequence lives in row ``j % block_size`` of pool block ``table[j // block_size]``;
sequences share the pool, and blocks can be shared between sequences (a common prefix).

A step names each row's table in ``ForwardBatch.block_tables``; a batch without tables uses the
cache's static slot tables (``KVCache.for_slots``: slot ``s`` owns a fixed run of blocks, the layout
every caller had before paging). The torch path writes with one ``index_copy_`` per entry and reads
one sequence's key range at a time (``read_range``: only the blocks that hold it, for
layers/paged_attention.py); the native decode kernel (native/cpu/attn_decode.c) walks the tables itself.
"""

from __future__ import annotations

import math

import torch

from moed.cache import q8_0

DEFAULT_BLOCK_SIZE = 16  # tokens per block (a power of two: the native kernel shifts instead of dividing)
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# what --kv-type names (llama.cpp's -ctk/-ctv names): int8 stands for q8_0 blocks (cache/q8_0.py)
KV_TYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "q8_0": torch.int8}


def kv_type_name(dtype: torch.dtype) -> str:
    return next(name for name, d in KV_TYPES.items() if d == dtype)


def kv_dtype_for(weight_dtype: torch.dtype | None) -> torch.dtype:
    """The KV dtype of a model whose non-expert weights have ``weight_dtype``: float32 stays float32;
    bf16, fp16 and quantised (None) models keep bfloat16 K/V (fp16's range can overflow on K)."""
    return torch.float32 if weight_dtype == torch.float32 else torch.bfloat16


# ``batch`` below is a runner.forward_batch.ForwardBatch (not imported: cache/ sits below runner/):
# starts, lengths, slots, block_tables, num_keys, host_positions, host_valid, memo, upload().


def kv_value_bytes(dtype: torch.dtype) -> float:
    """Bytes per stored K/V value (q8_0: an int8 and 1/32 of a float16 scale)."""
    return q8_0.bytes_per_value() if dtype == torch.int8 else torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(layer_entries: list[dict[str, tuple[int, ...]]], dtype: torch.dtype) -> int:
    values = sum(math.prod(shape) for entries in layer_entries for shape in entries.values())
    return math.ceil(values * kv_value_bytes(dtype))


class KVCache:
    def __init__(self, layer_entries: list[dict[str, tuple[int, ...]]], num_blocks: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None, *, state_shapes: list[dict[str, tuple[int, ...]]] | None = None,
                 num_state_slots: int = 0) -> None:
        """``layer_entries[i]`` maps an entry name ("k", "v", "latent", ...) to its per-token shape.
        ``state_shapes[i]``: per-sequence state of layer i (a hybrid model's linear layers: conv and
        recurrent state, float32), ``num_state_slots`` sequences of it (one per batch row)."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"KV block size must be a power of two, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        if dtype not in KV_TYPES.values():
            raise ValueError(f"KV dtype must be float32, bfloat16 or int8 (q8_0), got {dtype}")
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.generation = 0  # counts in-place resizes: kernels that kept the entries' addresses rebind
        self.quantized = dtype == torch.int8  # q8_0: each entry has a float16 scale per 32 values beside it
        self.layers = []
        for entries in layer_entries:
            pools = {}
            for name, shape in entries.items():
                pools[name] = torch.zeros(num_blocks, block_size, *shape, dtype=dtype, device=device)
                if self.quantized:
                    q8_0.check_row_size(name, shape[-1])
                    pools[name + q8_0.SCALE_SUFFIX] = torch.zeros(num_blocks, block_size, *shape[:-1],
                                                                  shape[-1] // q8_0.QK, dtype=torch.float16,
                                                                  device=device)
            self.layers.append(pools)
        self.num_slots = 0  # static slots (for_slots); 0: every step brings its own block tables
        self.max_len = 0
        self.states = [
            {name: torch.zeros(num_state_slots, *shape, dtype=torch.float32, device=device)
             for name, shape in entries.items()}
            for entries in (state_shapes or [])
        ]
        if any(self.states) and num_state_slots < 1:
            raise ValueError("a model with per-sequence state needs at least one state slot")

    @classmethod
    def for_slots(cls, layer_entries: list[dict[str, tuple[int, ...]]], num_slots: int, max_len: int,
                  dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE,
                  state_shapes: list[dict[str, tuple[int, ...]]] | None = None) -> "KVCache":
        """A pool with ``num_slots`` fixed sequences of up to ``max_len`` tokens (slot s: blocks
        ``[s * n, (s + 1) * n)``), for batches that name slots instead of block tables."""
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"a KV cache needs at least one slot of one token, got {num_slots} x {max_len}")
        per_slot = -(-max_len // block_size)
        cache = cls(layer_entries, num_slots * per_slot, block_size, dtype, device, state_shapes=state_shapes,
                    num_state_slots=num_slots if state_shapes else 0)
        cache.num_slots, cache.max_len = num_slots, max_len
        return cache

    def resized(self, num_blocks: int, moves: list[tuple[int, int]]) -> "KVCache":
        """This pool, resized to ``num_blocks`` blocks in place (the same object is returned): each ``(old, new)``
        move is applied inside the old tensor first, then each entry is replaced by its resized copy one at
        a time, so at most one entry exists twice (a shrink under memory pressure never holds two pools).
        The per-sequence states are untouched. Block tables only."""
        if self.num_slots:
            raise ValueError("a pool with static slots cannot be resized")
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        src = dst = None
        for entries in self.layers:
            for name in list(entries):
                t = entries.pop(name)
                if moves:
                    if src is None:
                        src = torch.tensor([old for old, _ in moves], dtype=torch.long, device=t.device)
                        dst = torch.tensor([new for _, new in moves], dtype=torch.long, device=t.device)
                    t.index_copy_(0, dst, t.index_select(0, src))  # into free blocks below the new size
                if num_blocks <= t.shape[0]:
                    resized = t[:num_blocks].clone()
                else:
                    resized = torch.zeros(num_blocks, *t.shape[1:], dtype=t.dtype, device=t.device)
                    resized[: t.shape[0]].copy_(t)
                del t  # the old entry goes before the next one is copied
                entries[name] = resized
        self.num_blocks = num_blocks
        self.generation += 1
        return self

    def nbytes(self) -> int:
        """The K/V pool's bytes (per-sequence states apart: ``state_nbytes``)."""
        return sum(t.numel() * t.element_size() for entries in self.layers for t in entries.values())

    def state_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for entries in self.states for t in entries.values())

    def state(self, layer: int, name: str) -> torch.Tensor:
        """``[state slots, ...]``: a per-sequence state of one layer (e.g. "conv", "recurrent")."""
        return self.states[layer][name]

    def state_slots(self, batch) -> list[int]:
        """Each row's state slot: the batch's ``state_slots``, or its static slots."""
        slots = batch.state_slots if batch.state_slots is not None else batch.slots
        num = next(iter(t.shape[0] for entries in self.states for t in entries.values()), 0)
        if any(not 0 <= s < num for s in slots):
            raise ValueError(f"state slots {slots} do not fit the {num} state slots of this cache")
        return list(slots)

    def entry(self, layer: int, name: str) -> torch.Tensor:
        """The whole ``[num_blocks, block_size, ...]`` pool of one entry (kernels that write and read in place)."""
        return self.layers[layer][name]

    def entry_scale(self, layer: int, name: str) -> torch.Tensor | None:
        """A q8_0 entry's float16 scales ``[num_blocks, block_size, ..., D / 32]`` (None unless quantized)."""
        return self.layers[layer][name + q8_0.SCALE_SUFFIX] if self.quantized else None

    # ---- block tables of a step (host lists in; tensors made once per step and memoised on the batch)

    def tables(self, batch) -> list[list[int]]:
        """Each row's block table: the batch's own, or its slot's static run of blocks."""
        if batch.block_tables is not None:
            tables = batch.block_tables
        else:
            if not self.num_slots:
                raise ValueError("this KV pool has no static slots: the step must give block tables")
            per_slot = self.num_blocks // self.num_slots
            for s in batch.slots:
                if not 0 <= s < self.num_slots:
                    raise ValueError(f"KV cache slot {s} does not exist ({self.num_slots} slots)")
            tables = [list(range(s * per_slot, (s + 1) * per_slot)) for s in batch.slots]
        for row, (table, start, length) in enumerate(zip(tables, batch.starts, batch.lengths)):
            need = -(-(start + length) // self.block_size)
            if need > len(table):
                raise ValueError(f"KV cache: row {row} needs {need} blocks for {start + length} tokens, its table "
                                 f"has {len(table)}")
            if any(not 0 <= b < self.num_blocks for b in table[:need]):
                raise ValueError(f"KV cache: row {row}'s block table names a block outside the pool "
                                 f"({self.num_blocks} blocks)")
        return tables

    def table_tensor(self, batch) -> torch.Tensor:
        """``[B, max_blocks]`` int32 on the host (rows padded with block 0), for the native kernels."""
        memo = batch.memo
        key = ("kv_table", id(self))
        if key not in memo:
            tables = self.tables(batch)
            width = max(1, max(len(t) for t in tables))
            out = torch.zeros(len(tables), width, dtype=torch.int32)
            for row, table in enumerate(tables):
                if table:
                    out[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
            memo[key] = out
        return memo[key]

    def _indices(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool rows written [N], their places [N] as flat indices into the step's [R * T]); on the batch's
        device."""
        memo = batch.memo
        key = ("kv_index", id(self))
        if key not in memo:
            bs, steps = self.block_size, batch.input_ids.shape[1]
            tables = self.tables(batch)
            write_rows, places = [], []
            for seq, table in enumerate(tables):
                row, off, start, n = batch.segment(seq)
                if not n:
                    continue
                pos = torch.arange(start, start + n)
                blocks = torch.tensor(table[: -(-(start + n) // bs)], dtype=torch.int64)
                write_rows.append(blocks[pos // bs] * bs + pos % bs)
                places.append(torch.arange(row * steps + off, row * steps + off + n))
            cat = lambda parts: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)  # noqa: E731
            memo[key] = tuple(batch.upload(cat(t)) for t in (write_rows, places))
        return memo[key]

    def _row_blocks(self, batch, row: int) -> torch.Tensor:
        """Row ``row``'s blocks for its keys 0..start+length-1, as an index tensor on the step's device (once
        per step and row)."""
        memo = batch.memo
        key = ("kv_row_blocks", id(self), row)
        if key not in memo:
            need = -(-(batch.starts[row] + batch.lengths[row]) // self.block_size)
            memo[key] = batch.upload(torch.tensor(self.tables(batch)[row][:need], dtype=torch.long))
        return memo[key]

    def read_range(self, layer: int, name: str, batch, row: int, j0: int, j1: int,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[j1 - j0, ...]``: keys j0..j1-1 of one row (positions its block table covers), in ``dtype``; reads
        only the blocks that hold them."""
        bs = self.block_size
        blocks = self._row_blocks(batch, row)[j0 // bs : -(-j1 // bs)]
        take = lambda store: store.index_select(0, blocks).reshape(-1, *store.shape[2:])[j0 % bs : j0 % bs + (j1 - j0)]  # noqa: E731
        out = take(self.layers[layer][name])
        if self.quantized:  # widened block by block: the read is as large as the keys asked for, no more
            return q8_0.dequantize(out, take(self.layers[layer][name + q8_0.SCALE_SUFFIX]), dtype or torch.float32)
        return out if dtype is None else out.to(dtype)

    def read_positions(self, layer: int, name: str, batch, row: int, positions: torch.Tensor,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[P, ...]``: the keys at ``positions`` (int64 [P], on the step's device, inside what the row's block
        table covers) of one row, in ``dtype`` (sparse attention's chosen keys)."""
        bs = self.block_size
        flat = self._row_blocks(batch, row)[positions // bs] * bs + positions % bs
        take = lambda store: store.view(-1, *store.shape[2:]).index_select(0, flat)  # noqa: E731
        out = take(self.layers[layer][name])
        if self.quantized:
            return q8_0.dequantize(out, take(self.layers[layer][name + q8_0.SCALE_SUFFIX]), dtype or torch.float32)
        return out if dtype is None else out.to(dtype)

    def write_positions(self, layer: int, name: str, values: torch.Tensor, batch, row: int,
                        positions: torch.Tensor) -> None:
        """Store ``values [P, ...]`` at ``positions`` (int64 [P], inside what row ``row``'s block table covers)
        of one row: entries written for earlier positions than the step's own (DeepSeek-V4's compressed entries,
        sliced over their window's slots). Float pools only."""
        if self.quantized:
            raise ValueError(f"KV entry {name!r}: position writes need a float pool, not q8_0")
        bs = self.block_size
        flat = self._row_blocks(batch, row)[positions // bs] * bs + positions % bs
        store = self.layers[layer][name]
        store.view(-1, *store.shape[2:]).index_copy_(0, flat, values.to(store.dtype))

    def write(self, layer: int, name: str, values: torch.Tensor, batch) -> None:
        """values [R, T, ...]: store each sequence's new tokens at their positions (cast to the pool's dtype)."""
        store = self.layers[layer][name]
        write_rows, places = self._indices(batch)
        flat = values.reshape(-1, *values.shape[2:]).index_select(0, places)
        if self.quantized:
            flat, scales = q8_0.quantize(flat)
            scale_store = self.layers[layer][name + q8_0.SCALE_SUFFIX]
            scale_store.view(-1, *scale_store.shape[2:]).index_copy_(0, write_rows, scales)
        store.view(-1, *store.shape[2:]).index_copy_(0, write_rows, flat.to(store.dtype))
