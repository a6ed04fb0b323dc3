"""Step execution, the engine loop's middle part: each scheduled chunk gets the KV blocks it writes
(a dry pool preempts the newest running sequence), then one forward over all of them.

Called on the engine loop's thread (engine/engine_loop.py) between scheduling (engine/scheduler.py)
and the step's outcome (engine/step_outcome.py). The scheduler and the KV manager are shared with
other threads' figures and cancels: what changes them here runs under the loop's lock.
"""

from __future__ import annotations

import threading

import torch

from moed.engine.kv_manager import KVManager, OutOfBlocks
from moed.engine.scheduler import ScheduledChunk, Scheduler
from moed.runner.forward_batch import ForwardBatch

Ready = tuple[ScheduledChunk, list[int]]  # a chunk and its sequence's block table, grown for what it writes


def grant_blocks(chunks: list[ScheduledChunk], kv: KVManager, scheduler: Scheduler, lock: threading.Lock,
                 preempted: set[int]) -> list[Ready]:
    """Each chunk with its sequence's block table, grown for the tokens it writes. When the pool runs dry
    the newest running sequence without blocks for this step yet is preempted (possibly the chunk's own):
    its blocks are released (its prefix stays cached), it goes back to the scheduler's queue, its id
    joins ``preempted``, and its chunk is dropped from the step. Raises OutOfBlocks when nothing is left
    to preempt (one sequence larger than the pool)."""
    ready: list[Ready] = []
    dropped: set[int] = set()
    for c in chunks:
        while c.seq_id not in dropped:
            try:
                ready.append((c, list(kv.ensure(c.seq_id, c.start + len(c.token_ids)))))
                break
            except OutOfBlocks:
                with lock:
                    victim = scheduler.newest_running({r.seq_id for r, _ in ready})
                    if victim is None:
                        raise
                    kv.release(victim, scheduler.cached_token_ids(victim))
                    scheduler.preempt(victim)
                    preempted.add(victim)
                dropped.add(victim)
    return ready


def step_batch(ready: list[Ready]) -> ForwardBatch:
    """The step's ForwardBatch: with block tables the batch's "slots" are the sequences' ids (the routing
    trace keys on them); chunks of different lengths are packed into one row (no padding: a decode row
    costs one token)."""
    chunks = [c for c, _ in ready]
    return ForwardBatch.from_token_lists([c.token_ids for c in chunks], [c.start for c in chunks],
                                         [c.seq_id for c in chunks], [t for _, t in ready],
                                         [c.slot for c in chunks], packed=True)


def run_forward(model, cache, checkpoints, ready: list[Ready]) -> torch.Tensor:
    """One forward over the ready chunks -> logits [len(ready), V] (each chunk's last token). A hybrid
    model's recurrent states are first restored from the checkpoints the chunks resume from."""
    if checkpoints.enabled:
        checkpoints.restore(cache, [c for c, _ in ready])
    return model.forward(step_batch(ready), cache)


__all__ = ["Ready", "grant_blocks", "run_forward", "step_batch"]
