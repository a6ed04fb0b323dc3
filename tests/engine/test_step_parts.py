"""The engine loop's step parts on their own (no model, no thread): block grants with preemption
(engine/step_execution.py) and a step's outcome (engine/step_outcome.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from moed.engine.kv_manager import KVManager
from moed.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from moed.engine.step_execution import grant_blocks, run_forward, step_batch
from moed.engine.step_outcome import ChunkOutcome, record_outcomes, sample_outcomes

BS = 4


def setup(num_blocks: int, prompts: list[list[int]], prefix_cache: bool = True):
    kv = KVManager(num_blocks, BS, prefix_cache=prefix_cache)
    sched = Scheduler(SchedulerConfig(max_batch=4, max_queue=8, prefill_chunk=64, max_step_tokens=256),
                      on_admit=lambda seq_id, ids: kv.admit(seq_id, ids, alone=True))
    ids = [sched.add(f"r{i}", p) for i, p in enumerate(prompts)]
    return kv, sched, ids


def test_grant_blocks_grows_every_table_for_what_its_chunk_writes():
    kv, sched, ids = setup(16, [list(range(1, 10)), list(range(20, 25))])
    chunks = sched.schedule().chunks
    preempted: set[int] = set()
    ready = grant_blocks(chunks, kv, sched, threading.Lock(), preempted)
    assert [c.seq_id for c, _ in ready] == ids and not preempted
    assert [len(t) for _, t in ready] == [3, 2]  # 9 and 5 tokens in blocks of 4
    assert not set(ready[0][1]) & set(ready[1][1])


def test_a_dry_pool_preempts_the_newest_sequence_and_drops_its_chunk():
    kv, sched, ids = setup(4, [list(range(1, 9)), list(range(20, 28))])  # 2 + 2 blocks: the pool is full
    for c, _ in grant_blocks(sched.schedule().chunks, kv, sched, threading.Lock(), set()):
        sched.record(c.seq_id, len(c.token_ids), 7 if c.samples else None)
    chunks = sched.schedule().chunks  # both decode: each needs a third block, none is free
    preempted: set[int] = set()
    ready = grant_blocks(chunks, kv, sched, threading.Lock(), preempted)
    assert [c.seq_id for c, _ in ready] == [ids[0]] and preempted == {ids[1]}
    assert len(ready[0][1]) == 3
    assert sched.running_ids() == [ids[0]] and sched.num_waiting == 1  # back in the queue, not failed


def test_a_chunk_that_cannot_fit_preempts_its_own_sequence_not_the_ones_already_granted():
    kv, sched, ids = setup(3, [list(range(1, 5)), list(range(20, 31))])  # 1 block, then 3 of the 2 left
    preempted: set[int] = set()
    ready = grant_blocks(sched.schedule().chunks, kv, sched, threading.Lock(), preempted)
    assert [c.seq_id for c, _ in ready] == [ids[0]] and preempted == {ids[1]}
    assert kv.allocator.num_free == 2  # the preempted sequence's blocks went back


def test_the_step_batch_packs_chunks_of_different_lengths_without_padding():
    a = ScheduledChunk(seq_id=3, slot=0, start=0, token_ids=[1, 2, 3, 4, 5], samples=True)
    b = ScheduledChunk(seq_id=5, slot=1, start=9, token_ids=[6], samples=True)
    batch = step_batch([(a, [0, 1]), (b, [2, 3, 4])])
    assert batch.input_ids.numel() == 6  # a decode row costs one token
    tokens = [batch.input_ids[row, off:off + n].tolist() for row, off, _, n in map(batch.segment, range(2))]
    assert tokens == [[1, 2, 3, 4, 5], [6]] and batch.token_sequences() == [0, 0, 0, 0, 0, 1]


def test_run_forward_restores_hybrid_states_before_the_model_runs():
    calls = []
    model = SimpleNamespace(forward=lambda batch, cache: calls.append(("forward", batch.input_ids.numel())) or
                            torch.zeros(1, 3))
    checkpoints = SimpleNamespace(enabled=True, restore=lambda cache, chunks: calls.append(("restore", len(chunks))))
    chunk = ScheduledChunk(seq_id=0, slot=0, start=0, token_ids=[1, 2], samples=True)
    run_forward(model, None, checkpoints, [(chunk, [0])])
    assert calls == [("restore", 1), ("forward", 2)]


class _Live:
    def __init__(self, token=None, reason="", fail=False):
        self.token, self.reason, self.fail = token, reason, fail

    def accept(self, logits, num_cached, eos_ids, context_length):
        if self.fail:
            raise RuntimeError("probabilities contain nan")
        return (int(logits.argmax()) if self.token is None else self.token), self.reason


def test_a_failed_sample_ends_only_its_own_sequence():
    chunks = [ScheduledChunk(0, 0, 0, [1, 2], samples=False), ScheduledChunk(1, 1, 4, [9], samples=True),
              ScheduledChunk(2, 2, 6, [8], samples=True)]
    logits = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    out = sample_outcomes(chunks, logits, {0: _Live(), 1: _Live(), 2: _Live(fail=True)}, frozenset(), 64)
    assert out[0] == ChunkOutcome(chunks[0], None)  # mid-prompt: nothing sampled
    assert out[1] == ChunkOutcome(chunks[1], 2)  # its own logits row
    assert out[2].token is None and out[2].reason == "error" and "nan" in out[2].error


def test_record_publishes_prefilled_blocks_and_returns_what_ends():
    kv, sched, ids = setup(16, [list(range(1, 10)), list(range(20, 25))])
    chunks = sched.schedule().chunks
    grant_blocks(chunks, kv, sched, threading.Lock(), set())
    outcomes = [ChunkOutcome(chunks[0], 42), ChunkOutcome(chunks[1], 7, "eos")]
    ended = record_outcomes(outcomes, sched, kv, SimpleNamespace(enabled=False), None)
    assert [o.chunk.seq_id for o in ended] == [ids[1]]
    (decode,) = [c for c in sched.schedule().chunks if c.seq_id == ids[0]]
    assert decode.token_ids == [42] and decode.start == 9  # the sampled token is the sequence's next
    # the going sequence's whole prompt blocks are in the prefix tree already (two of 9 tokens)
    assert kv.tree.match_prefix(list(range(1, 10))).num_blocks == 2


def test_record_takes_hybrid_checkpoints_of_the_sequences_that_go_on_only():
    kv, sched, _ = setup(16, [list(range(1, 6)), list(range(20, 25))])
    chunks = sched.schedule().chunks
    taken = []
    hybrid = SimpleNamespace(enabled=True, take=lambda cache, cs: taken.extend(c.seq_id for c in cs))
    record_outcomes([ChunkOutcome(chunks[0], 1), ChunkOutcome(chunks[1], 2, "length")], sched, kv, hybrid, None)
    assert taken == [chunks[0].seq_id]
