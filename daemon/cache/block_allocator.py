"""BlockAllocator: the free list and reference counts of a paged KV pool's blocks (ints only).

A block is held by every running sequence whose block table names it and by the prefix tree when
it stores it; it returns to the free list when its last holder lets go. Not thread-safe: the
engine loop is its only user.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(MemoryError):
    """The pool has fewer free blocks than asked for (the caller may evict cached prefixes and retry)."""


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def alloc(self, n: int) -> list[int]:
        """``n`` free blocks, each with one reference (its caller's); all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"{n} KV blocks asked for, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def resize(self, num_blocks: int) -> list[tuple[int, int]]:
        """Grow, or shrink to ``num_blocks`` by moving every held block at or above it into a free one below;
        returns the moves ``(old, new)`` (the holders rewrite their tables with them). Raises OutOfBlocks
        when more blocks are held than the new size."""
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        if num_blocks >= self.num_blocks:
            self._free.extend(range(self.num_blocks, num_blocks))
            self._refs.extend([0] * (num_blocks - self.num_blocks))
            self.num_blocks = num_blocks
            return []
        if self.num_used > num_blocks:
            raise OutOfBlocks(f"{self.num_used} KV blocks are held; the pool cannot shrink to {num_blocks}")
        low_free = sorted(b for b in self._free if b < num_blocks)
        high_held = [b for b in range(num_blocks, self.num_blocks) if self._refs[b] > 0]
        moves = list(zip(high_held, low_free))
        for old, new in moves:
            self._refs[new], self._refs[old] = self._refs[old], 0
        self._refs = self._refs[:num_blocks]
        self._free = deque(b for b in range(num_blocks) if self._refs[b] == 0)
        self.num_blocks = num_blocks
        return moves

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"KV block {b} is free: a holder can only share a block that is held")
            self._refs[b] += 1

    def decref(self, blocks: list[int]) -> int:
        """Drop one reference to each block; returns how many went back to the free list."""
        freed = 0
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"KV block {b} was released more often than it was taken")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
                freed += 1
        return freed
