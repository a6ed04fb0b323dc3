"""The prefix tree and the block allocator: matching, insertion, splits, locks, LRU eviction, refcounts."""

from __future__ import annotations

import random

import pytest

from moed.cache.block_allocator import BlockAllocator, OutOfBlocks
from moed.cache.radix_cache import RadixCache

BS = 4


def _seq(tree: RadixCache, tokens: list[int]) -> list[int]:
    """A sequence that computed all of ``tokens`` itself, then finished: insert, release its own refs."""
    blocks = tree.allocator.alloc(len(tokens) // BS)
    tree.insert(tokens, blocks)
    tree.allocator.decref(blocks)
    return blocks


def test_allocator_counts_holders_and_refuses_what_it_does_not_have():
    a = BlockAllocator(4)
    blocks = a.alloc(3)
    assert a.num_free == 1 and all(a.refs(b) == 1 for b in blocks)
    a.incref(blocks[:1])
    assert a.decref(blocks) == 2 and a.num_free == 3  # the shared block is still held
    assert a.decref(blocks[:1]) == 1 and a.num_free == 4
    with pytest.raises(OutOfBlocks, match="5 KV blocks asked for, 4 of 4 free"):
        a.alloc(5)
    assert a.num_free == 4  # all or nothing
    with pytest.raises(ValueError, match="released more often"):
        a.decref([0])
    with pytest.raises(ValueError, match="is free"):
        a.incref([0])


def test_the_longest_whole_block_prefix_is_found_and_splits_keep_every_block():
    tree = RadixCache(BlockAllocator(32), BS)
    first = list(range(100, 112))  # 3 blocks
    blocks = _seq(tree, first)
    assert tree.num_blocks == 3 and tree.allocator.num_free == 29
    m = tree.match_prefix(first + [7, 8])
    assert m.blocks == blocks
    # a prompt that leaves after 1.5 blocks matches one block, and the edge is split there
    other = first[:6] + [1, 2, 3, 4, 5, 6]
    m = tree.match_prefix(other)
    assert m.blocks == blocks[:1] and len(m.node.key) == BS
    assert tree.match_prefix(first).blocks == blocks  # the split lost nothing
    # the other sequence reuses block 0, computes two of its own, and is inserted beside
    own = tree.allocator.alloc(2)
    assert tree.insert(other[:12], blocks[:1] + own) == 1
    tree.allocator.decref(own)
    assert tree.match_prefix(other).blocks == blocks[:1] + own
    assert tree.num_blocks == 5
    assert tree.match_prefix([9, 9, 9, 9, 9]).blocks == []
    assert tree.match_prefix(first[:3]).blocks == []  # less than a block matches nothing


def test_an_identical_sequence_inserted_twice_keeps_the_first_blocks():
    tree = RadixCache(BlockAllocator(16), BS)
    tokens = list(range(8))
    kept = _seq(tree, tokens)
    dup = tree.allocator.alloc(2)
    assert tree.insert(tokens, dup) == 2  # all cached already: the tree takes nothing
    assert tree.allocator.decref(dup) == 2  # so the duplicate's blocks go back to the pool
    assert tree.match_prefix(tokens).blocks == kept


def test_eviction_takes_unlocked_leaves_least_recently_used_first():
    alloc = BlockAllocator(12)
    tree = RadixCache(alloc, BS)
    a, b, c = ([k] * 8 for k in (1, 2, 3))
    for tokens in (a, b, c):
        _seq(tree, tokens)
    assert alloc.num_free == 6
    tree.match_prefix(a)  # a is now the most recent
    m = tree.match_prefix(b)
    tree.lock(m.node)  # b is in use
    assert tree.evictable_blocks() == 4
    assert tree.evict(1) == 2  # c: the oldest unlocked leaf, both of its blocks
    assert tree.match_prefix(c).blocks == [] and tree.match_prefix(a).blocks
    assert tree.evict(100) == 2 and alloc.num_free == 10  # a goes too; b is locked
    assert tree.match_prefix(b).blocks
    tree.unlock(m.node)
    assert tree.clear() == 2 and alloc.num_free == 12 and tree.num_blocks == 0
    with pytest.raises(ValueError, match="unlocked more often"):
        tree.unlock(m.node)


def test_a_block_still_used_by_a_running_sequence_survives_eviction_of_its_node():
    alloc = BlockAllocator(8)
    tree = RadixCache(alloc, BS)
    tokens = list(range(8))
    _seq(tree, tokens)
    m = tree.match_prefix(tokens)
    alloc.incref(m.blocks)  # a running sequence reads them (without locking, for this test)
    assert tree.evict(10) == 0  # the tree let go, but the blocks are not free
    assert all(alloc.refs(b) == 1 for b in m.blocks) and alloc.num_free == 6
    alloc.decref(m.blocks)
    assert alloc.num_free == 8


def test_random_conversations_keep_refcounts_and_the_tree_consistent():
    """Random insert / match / lock / evict: every block is free or held by exactly its holders, and every
    match returns blocks that hold exactly those tokens."""
    rnd = random.Random(3)
    alloc = BlockAllocator(64)
    tree = RadixCache(alloc, BS)
    owner: dict[int, tuple[int, ...]] = {}  # block -> the tokens it was computed for (prefix up to it)
    locked = []
    for _ in range(300):
        base = rnd.choice([[1] * 8, [2] * 4, []])
        tokens = base + [rnd.randrange(4) for _ in range(rnd.randrange(0, 20))]
        m = tree.match_prefix(tokens)
        for i, blk in enumerate(m.blocks):
            assert owner[blk] == tuple(tokens[: (i + 1) * BS]), "a match returned another prefix's block"
        need = len(tokens) // BS - m.num_blocks
        if alloc.num_free < need:
            tree.evict(need - alloc.num_free)
        if alloc.num_free < need:
            continue
        alloc.incref(m.blocks)
        own = alloc.alloc(need)
        for i, blk in enumerate(own):
            owner[blk] = tuple(tokens[: (m.num_blocks + i + 1) * BS])
        tree.insert(tokens, m.blocks + own)
        alloc.decref(m.blocks + own)
        if rnd.random() < 0.2:
            tree.lock(m.node)
            locked.append(m.node)
        if locked and rnd.random() < 0.3:
            tree.unlock(locked.pop(rnd.randrange(len(locked))))
    held = [b for b in range(64) if alloc.refs(b) > 0]
    assert len(held) == tree.num_blocks == 64 - alloc.num_free
    for node in locked:
        tree.unlock(node)
    tree.clear()
    assert alloc.num_free == 64 and tree.num_blocks == 0
