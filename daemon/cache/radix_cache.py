"""RadixCache: KV blocks of earlier requests, found again by their token prefix (ints only).

A radix tree over token ids at block granularity: each edge is a run of whole blocks (its tokens,
a multiple of ``block_size``, and the pool blocks that hold their K/V). A new request walks the tree
with its prompt and reuses the longest cached run of whole blocks; a finished sequence inserts its
blocks so that the next request of the same conversation finds them. The tree holds one reference
on every block it stores (``BlockAllocator``); running sequences hold their own. Nodes on the path
of a running sequence are locked (``lock`` / ``unlock``); eviction removes unlocked leaves, least
recently used first (the order is a swappable ``EvictionOrder``), and frees the blocks nobody else
holds. Learned from sglang's ``mem_cache/radix_cache.py``; not thread-safe (the engine loop owns it).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

from moed.cache.block_allocator import BlockAllocator


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()  # the tokens of this edge (a multiple of block_size)
    blocks: list[int] = field(default_factory=list)  # one pool block per block_size tokens of key
    parent: "RadixNode | None" = None
    children: dict[tuple[int, ...], "RadixNode"] = field(default_factory=dict)  # by their first block's tokens
    lock_ref: int = 0  # running sequences whose prefix passes through here
    last_access: int = 0
    checkpoint: object = None  # hybrid models: the recurrent state after this node's last token (KVManager)


# the eviction order: a key per evictable leaf, smallest evicted first (LRU: the oldest access)
EvictionOrder = Callable[[RadixNode], float]


def lru(node: RadixNode) -> float:
    return node.last_access


@dataclass(frozen=True)
class PrefixMatch:
    blocks: list[int]  # pool blocks of the matched tokens, in order
    node: RadixNode  # the deepest node matched (lock it while the blocks are in use)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class RadixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, order: EvictionOrder = lru,
                 on_evict: Callable[[RadixNode], None] | None = None) -> None:
        """``on_evict(node)``: called for each node removed (its checkpoint goes with it)."""
        self.allocator, self.block_size, self.order, self.on_evict = allocator, block_size, order, on_evict
        self.root = RadixNode()
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_blocks = 0  # blocks the tree stores
        self.evicted_blocks = 0
        self._evictable = 0  # blocks of unlocked nodes, kept up to date (admission reads it every step)

    def _block_key(self, tokens, i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.block_size])

    def _common_blocks(self, key: tuple[int, ...], tokens, start: int) -> int:
        """Whole blocks at the head of ``key`` equal to ``tokens[start:]``."""
        bs, n = self.block_size, 0
        while (n + 1) * bs <= len(key) and start + (n + 1) * bs <= len(tokens) \
                and key[n * bs : (n + 1) * bs] == tuple(tokens[start + n * bs : start + (n + 1) * bs]):
            n += 1
        return n

    def _split(self, child: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``child``'s edge after ``num_blocks`` blocks; returns the new upper node."""
        bs = self.block_size
        upper = RadixNode(child.key[: num_blocks * bs], child.blocks[:num_blocks], child.parent,
                          lock_ref=child.lock_ref, last_access=child.last_access)
        upper.parent.children[upper.key[:bs]] = upper
        child.key, child.blocks, child.parent = child.key[num_blocks * bs :], child.blocks[num_blocks:], upper
        upper.children[child.key[:bs]] = child
        return upper

    def match_prefix(self, tokens) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` in whole blocks (touched as recently used)."""
        node, blocks, i, now = self.root, [], 0, next(self._clock)
        while i + self.block_size <= len(tokens):
            child = node.children.get(self._block_key(tokens, i))
            if child is None:
                break
            n = self._common_blocks(child.key, tokens, i)  # >= 1: the first block matched
            partial = n * self.block_size < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            blocks.extend(child.blocks)
            i += len(child.key)
            node = child
            if partial:
                break
        return PrefixMatch(blocks, node)

    def insert(self, tokens, blocks: list[int]) -> int:
        """Store ``blocks`` as the K/V of ``tokens`` (``len(blocks)`` whole blocks of it); the tree takes a
        reference on the blocks it did not have. Returns how many blocks were already cached."""
        bs = self.block_size
        if len(tokens) < len(blocks) * bs:
            raise ValueError(f"{len(blocks)} blocks need {len(blocks) * bs} tokens, got {len(tokens)}")
        tokens = tokens[: len(blocks) * bs]
        node, i, now = self.root, 0, next(self._clock)
        while i < len(tokens):
            child = node.children.get(self._block_key(tokens, i))
            if child is None:
                leaf = RadixNode(tuple(tokens[i:]), list(blocks[i // bs :]), node, last_access=now)
                node.children[leaf.key[:bs]] = leaf
                self.allocator.incref(leaf.blocks)
                self.num_blocks += len(leaf.blocks)
                self._evictable += len(leaf.blocks)  # a new leaf is unlocked
                return i // bs
            n = self._common_blocks(child.key, tokens, i)
            if n * bs < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            i += len(child.key)
            node = child
        return len(blocks)

    @staticmethod
    def depth(node: RadixNode) -> int:
        """Tokens from the root to the end of ``node``."""
        n = 0
        while node is not None:
            n += len(node.key)
            node = node.parent
        return n

    def lock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref < 1:
                raise ValueError("radix cache: a node was unlocked more often than it was locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.blocks)
            node = node.parent

    def evictable_blocks(self) -> int:
        """Blocks held by unlocked nodes (what ``evict`` could give up at most); O(1), kept up to date by
        insert / lock / unlock / evict. Every block a running sequence holds that the tree stores is on a
        locked path (KVManager locks what it inserts for a running sequence), so each of these blocks
        goes back to the pool when evicted."""
        return self._evictable

    def count_evictable_blocks(self) -> int:
        """``evictable_blocks`` counted by walking the tree (for tests of the maintained count)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            if node.lock_ref == 0:
                total += len(node.blocks)
            stack.extend(node.children.values())
        return total

    def evict(self, num_free_wanted: int) -> int:
        """Remove unlocked leaves in eviction order until ``num_free_wanted`` blocks went back to the pool
        (or nothing unlocked is left); returns the blocks freed."""
        heap, tie = [], itertools.count()
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node.lock_ref == 0:
                heapq.heappush(heap, (self.order(node), next(tie), node))
        freed = 0
        while heap and freed < num_free_wanted:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[: self.block_size]]
            freed += self.allocator.decref(leaf.blocks)
            self._evictable -= len(leaf.blocks)
            if self.on_evict is not None:
                self.on_evict(leaf)
            self.num_blocks -= len(leaf.blocks)
            self.evicted_blocks += len(leaf.blocks)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self.order(parent), next(tie), parent))
        return freed

    def remap(self, moves: dict[int, int]) -> None:
        """Rewrite the blocks every node stores after a pool resize moved them (``old -> new``)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.blocks = [moves.get(b, b) for b in node.blocks]
            stack.extend(node.children.values())

    def clear(self) -> int:
        """Drop every unlocked node (e.g. the pool is being resized); returns the blocks freed."""
        return self.evict(self.allocator.num_blocks + 1)
