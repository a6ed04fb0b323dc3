"""A step's outcome, the engine loop's last part: each chunk's sampled token (or none), then what the
step changes in the scheduler, the prefix cache and the hybrid checkpoints.

``sample_outcomes`` runs on the loop thread without the lock (sampling, detokenizing and streaming are
each request's own: engine/live_request.py); ``record_outcomes`` runs under the loop's lock and returns
the outcomes whose sequences end, for the loop to finish. A chunk whose sampling raises ends with
"error" alone; the other chunks of the step go on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch

from moed.engine.kv_manager import KVManager
from moed.engine.live_request import LiveRequest
from moed.engine.scheduler import ScheduledChunk, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkOutcome:
    chunk: ScheduledChunk
    token: int | None  # the token sampled from the chunk's logits; None when it does not sample or failed
    reason: str = ""  # finish reason when the sequence ends here ("stop", "length", "error", ...)
    error: str = ""


def sample_outcomes(chunks: list[ScheduledChunk], logits: torch.Tensor, live: Mapping[int, LiveRequest],
                    eos_ids: frozenset[int], context_length: int, *, name: str = "") -> list[ChunkOutcome]:
    """Row i of ``logits`` belongs to chunks[i]; a chunk that ends its prompt or decodes samples from it."""
    outcomes: list[ChunkOutcome] = []
    for row, chunk in enumerate(chunks):
        if not chunk.samples:
            outcomes.append(ChunkOutcome(chunk, None))
            continue
        try:
            token, reason = live[chunk.seq_id].accept(logits[row], chunk.start + len(chunk.token_ids), eos_ids,
                                                      context_length)
            outcomes.append(ChunkOutcome(chunk, token, reason))
        except Exception as exc:
            log.exception("engine %s: sampling failed", name)
            outcomes.append(ChunkOutcome(chunk, None, "error", f"sampling failed: {type(exc).__name__}: {exc}"))
    return outcomes


def record_outcomes(outcomes: list[ChunkOutcome], scheduler: Scheduler, kv: KVManager, checkpoints,
                    cache) -> list[ChunkOutcome]:
    """(Caller holds the loop's lock.) Every chunk's tokens count as fed (and its sampled token as the
    sequence's next); the sequences that go on get their recurrent-state checkpoints (hybrid models) or
    share their prefilled prompt blocks at once (prefix cache), not only when they end. Returns the
    outcomes that end their sequence."""
    for o in outcomes:
        scheduler.record(o.chunk.seq_id, len(o.chunk.token_ids), o.token)
    going = [o for o in outcomes if not o.reason]
    if checkpoints.enabled:
        checkpoints.take(cache, [o.chunk for o in going])
    elif kv.prefix_cache:
        for o in going:
            if len(o.chunk.token_ids) > 1:
                kv.publish(o.chunk.seq_id, scheduler.cached_token_ids(o.chunk.seq_id))
    return [o for o in outcomes if o.reason]


__all__ = ["ChunkOutcome", "record_outcomes", "sample_outcomes"]
