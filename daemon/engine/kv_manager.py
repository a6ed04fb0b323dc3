"""KVManager: which KV pool blocks each running sequence uses, and the prefix cache across requests.

The engine loop asks it, per sequence: at admission, how many prompt tokens are already cached
(``admit``: the longest whole-block prefix in the radix tree, leaving at least the last prompt token
to compute, so the step that ends the prompt yields logits); before each step, blocks for the tokens
the step writes (``ensure``: from the free list, evicting cached prefixes when it runs dry); at the
end, the sequence's full blocks go into the tree for the next request (``release``). Control code:
ints only, the pool tensors live in ``cache/kv_cache.KVCache``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from moed.cache.block_allocator import BlockAllocator, OutOfBlocks
from moed.cache.kv_cache import DEFAULT_BLOCK_SIZE
from moed.errors import InvalidRequestError, quoted
from moed.cache.radix_cache import PrefixMatch, RadixCache, RadixNode


def kv_pool_tokens(context: int, max_batch: int, kv_tokens: int | None = None,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Tokens of the KV pool (whole blocks): ``kv_tokens`` when given (at least one whole context), else
    room for two sequences of the whole context (or ``max_batch`` of them when that is fewer). Short
    sequences pack many more; what running sequences leave free holds cached prefixes."""
    if kv_tokens is None:
        tokens = context * min(max_batch, 2)
    else:
        if isinstance(kv_tokens, bool) or not isinstance(kv_tokens, int) or kv_tokens < context:
            raise InvalidRequestError(f"kv_tokens={quoted(kv_tokens)}: the KV pool must hold at least one whole "
                                      f"context ({context} tokens); lower the context length or raise kv_tokens")
        tokens = kv_tokens
    return -(-tokens // block_size) * block_size


@dataclass
class _SeqBlocks:
    blocks: list[int] = field(default_factory=list)  # the block table, in token order
    node: RadixNode | None = None  # the matched prefix's node, locked while the sequence runs
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    restore: object = None  # hybrid models: the state checkpoint to load before its first step


@dataclass
class KVFigures:
    num_blocks: int = 0
    block_size: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0  # held by the prefix tree
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_tokens: int = 0  # of which found in the prefix cache (not prefilled again)
    evicted_blocks: int = 0
    prefix_cache: bool = False
    checkpoints: int = 0  # hybrid models: recurrent-state checkpoints held
    checkpoint_bytes: int = 0
    pool_bytes: int = 0  # filled in by the engine loop (the pool tensors' size)
    preempted: int = 0  # filled in by the engine loop: sequences put back in the queue for want of blocks


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_cache: bool = True, checkpoints: bool = False,
                 checkpoint_bytes: int = 1 << 30) -> None:
        """``checkpoints``: a hybrid model, whose linear layers resume only from a state checkpoint: a prefix
        is reused up to the deepest checkpoint on its path, and ``checkpoint`` stores them (LRU, at most
        ``checkpoint_bytes``)."""
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.tree = RadixCache(self.allocator, block_size, on_evict=self._drop_checkpoint) if prefix_cache else None
        self.checkpoints = checkpoints and prefix_cache
        self.checkpoint_budget = checkpoint_bytes
        self._ckpts: OrderedDict[RadixNode, None] = OrderedDict()  # nodes holding a checkpoint, oldest first
        self.checkpoint_bytes = 0
        self.checkpoints_taken = self.checkpoints_dropped = 0
        self._seqs: dict[int, _SeqBlocks] = {}
        self._prompt_tokens = 0
        self._cached_tokens = 0

    @property
    def prefix_cache(self) -> bool:
        return self.tree is not None

    def admit(self, seq_id: int, prompt_ids: list[int], *, alone: bool = False, resumed: bool = False) -> int | None:
        """Start a sequence; returns how many of its first prompt tokens are already in the pool, or None
        when the pool cannot hold the rest of the prompt now (blocks free or held only by the prefix
        cache). ``alone``: nothing else runs, so admit it whatever the count says (a prompt never
        exceeds the pool). ``resumed``: a preempted sequence coming back (not counted as a new prompt)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} was already admitted")
        match = None
        if self.tree is not None and len(prompt_ids) >= 2:
            match = self.tree.match_prefix(prompt_ids[: len(prompt_ids) - 1])  # the last token is always computed
            if self.checkpoints:
                match = self._deepest_checkpoint(match)
        matched = match.num_blocks if match is not None else 0
        need = -(-len(prompt_ids) // self.block_size) - matched
        room = self.allocator.num_free + (self.tree.evictable_blocks() if self.tree is not None else 0)
        if not alone and need > room - (self._unlocked_in(match) if match is not None else 0):
            return None
        seq = self._seqs[seq_id] = _SeqBlocks()
        if not resumed:
            self._prompt_tokens += len(prompt_ids)
        if matched:
            self.allocator.incref(match.blocks)
            self.tree.lock(match.node)
            seq.blocks, seq.node = list(match.blocks), match.node
            seq.cached_tokens = matched * self.block_size
            if self.checkpoints:
                seq.restore = match.node.checkpoint
                self._ckpts.move_to_end(match.node)
            if not resumed:
                self._cached_tokens += seq.cached_tokens
        return seq.cached_tokens

    def _deepest_checkpoint(self, match) -> "PrefixMatch | None":
        """The match cut back to the deepest node on its path that holds a state checkpoint (None: none)."""
        node = match.node
        while node is not None and node.checkpoint is None:
            node = node.parent
        if node is None or node is self.tree.root:
            return None
        depth = RadixCache.depth(node)
        return PrefixMatch(match.blocks[: depth // self.block_size], node)

    def take_restore(self, seq_id: int):
        """The checkpoint a just-admitted sequence must load before its first step (once; None: none)."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.restore is None:
            return None
        (payload, _nbytes), seq.restore = seq.restore, None
        return payload

    def checkpoint(self, seq_id: int, token_ids: list[int], payload, nbytes: int) -> bool:
        """Keep ``payload`` (a hybrid model's state after ``token_ids``, a whole number of blocks of the
        sequence) in the tree at that prefix; older checkpoints go when the budget is exceeded."""
        if not self.checkpoints or len(token_ids) % self.block_size or not token_ids or nbytes > self.checkpoint_budget:
            return False
        seq = self._seqs[seq_id]
        full = len(token_ids) // self.block_size
        if full > len(seq.blocks):
            raise ValueError(f"sequence {seq_id} has {len(seq.blocks)} blocks, a checkpoint after {full} was asked")
        self.tree.insert(token_ids, seq.blocks[:full])
        node = self.tree.match_prefix(token_ids).node  # ends exactly after token_ids (a split if need be)
        self._hold(seq, node)
        if node.checkpoint is not None:
            self._drop_checkpoint(node)
        node.checkpoint = (payload, nbytes)
        self._ckpts[node] = None
        self.checkpoint_bytes += nbytes
        self.checkpoints_taken += 1
        while self.checkpoint_bytes > self.checkpoint_budget and self._ckpts:
            self._drop_checkpoint(next(iter(self._ckpts)))
        return True

    def _drop_checkpoint(self, node: RadixNode) -> None:
        if node.checkpoint is None:
            return
        self.checkpoint_bytes -= node.checkpoint[1]
        node.checkpoint = None
        self._ckpts.pop(node, None)
        self.checkpoints_dropped += 1

    @staticmethod
    def _unlocked_in(match) -> int:
        """Blocks of the match's path counted as evictable now (they are about to be locked)."""
        n, node = 0, match.node
        while node is not None:
            if node.lock_ref == 0:
                n += len(node.blocks)
            node = node.parent
        return n

    def cached_tokens(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id)
        return 0 if seq is None else seq.cached_tokens

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        """The sequence's block table, grown to hold ``num_tokens`` tokens. Raises OutOfBlocks when the pool
        has no room even after evicting every unlocked cached prefix."""
        seq = self._seqs[seq_id]
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > 0:
            short = need - self.allocator.num_free
            if short > 0 and self.tree is not None:
                self.tree.evict(short)
            seq.blocks.extend(self.allocator.alloc(need))
        return seq.blocks

    def table(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id].blocks

    def publish(self, seq_id: int, token_ids: list[int]) -> int:
        """Put the whole blocks of a running sequence's prefilled ``token_ids`` into the prefix tree now, locked
        for as long as it runs: a request with the same prefix that arrives while this one still runs (or
        is being cancelled) reuses them instead of prefilling them again, as SGLang and vLLM share prompt
        blocks once prefilled. Returns the tokens published (0: nothing new). Not for hybrid models, whose
        prefixes are reused only up to state checkpoints."""
        seq = self._seqs.get(seq_id)
        if seq is None or self.tree is None or self.checkpoints:
            return 0
        full = min(len(token_ids) // self.block_size, len(seq.blocks))
        depth = RadixCache.depth(seq.node) if seq.node is not None else 0
        if full * self.block_size <= depth:
            return 0
        prefix = token_ids[: full * self.block_size]
        self.tree.insert(prefix, seq.blocks[:full])
        self._hold(seq, self.tree.match_prefix(prefix).node)  # the node ends exactly after the prefix
        return len(prefix)

    def _hold(self, seq: _SeqBlocks, node: RadixNode) -> None:
        """Lock the path to ``node`` (blocks of ``seq`` just inserted) for as long as ``seq`` runs, in place of
        its shallower lock: blocks a running sequence holds are never counted as evictable."""
        if seq.node is not None and RadixCache.depth(seq.node) >= RadixCache.depth(node):
            return
        self.tree.lock(node)
        if seq.node is not None:
            self.tree.unlock(seq.node)
        seq.node = node

    def release(self, seq_id: int, token_ids: list[int] | None) -> None:
        """End a sequence. ``token_ids``: the tokens whose K/V its blocks hold (None: do not cache them,
        e.g. after a failed step); their whole blocks go into the prefix tree."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if self.tree is not None:
            if token_ids and not self.checkpoints:  # a hybrid model's K/V are reusable only up to checkpoints
                full = min(len(token_ids) // self.block_size, len(seq.blocks))
                self.tree.insert(token_ids[: full * self.block_size], seq.blocks[:full])
            if seq.node is not None:
                self.tree.unlock(seq.node)
        self.allocator.decref(seq.blocks)

    def resize(self, num_blocks: int) -> list[tuple[int, int]]:
        """Grow the pool, or shrink it (cached prefixes evicted first, then the blocks still held moved below
        the new size): returns the moves ``(old, new)`` for the pool's contents. The running sequences'
        tables and the tree are rewritten here. Raises OutOfBlocks when running sequences hold more."""
        over = self.allocator.num_used - num_blocks
        if over > 0 and self.tree is not None:
            self.tree.evict(over)
        moves = self.allocator.resize(num_blocks)
        if moves:
            remap = dict(moves)
            for seq in self._seqs.values():
                seq.blocks = [remap.get(b, b) for b in seq.blocks]
            if self.tree is not None:
                self.tree.remap(remap)
        return moves

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_in_use(self) -> int:
        """Blocks running sequences hold (what is left once every cached prefix is evicted)."""
        return len({b for seq in self._seqs.values() for b in seq.blocks})

    def clear_cache(self) -> int:
        """Drop every cached prefix no running sequence uses; returns the blocks freed."""
        return 0 if self.tree is None else self.tree.clear()

    def figures(self) -> KVFigures:
        return KVFigures(self.allocator.num_blocks, self.block_size, self.allocator.num_used,
                         0 if self.tree is None else self.tree.num_blocks, self._prompt_tokens, self._cached_tokens,
                         0 if self.tree is None else self.tree.evicted_blocks, self.tree is not None,
                         len(self._ckpts), self.checkpoint_bytes)


__all__ = ["KVManager", "KVFigures", "OutOfBlocks", "kv_pool_tokens"]
