"""Scheduler: the waiting queue, the running set (one KV slot each) and what each step feeds (ints only).

Continuous batching: a waiting sequence takes a free slot at any step. Each step feeds every
decoding sequence its one new token first, then prompt chunks (at most ``prefill_chunk`` tokens
per sequence) in admission order while the step's ``max_step_tokens`` budget lasts, so a long
prompt is spread over several steps instead of stalling everyone else's decode.

Not thread-safe: the engine loop guards it with its lock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from moed.errors import InvalidRequestError, QueueFullError, quoted


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8  # running sequences = KV-cache slots
    max_queue: int = 64  # sequences waiting for a slot
    prefill_chunk: int = 512  # prompt tokens per sequence per step
    max_step_tokens: int = 1024  # tokens per step, all sequences together

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "prefill_chunk", "max_step_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name}={quoted(value)}: must be an integer >= 1")
        if self.max_step_tokens < self.max_batch:
            raise InvalidRequestError(
                f"max_step_tokens={self.max_step_tokens} is below max_batch={self.max_batch}: every running "
                "sequence's decode token must fit in one step; raise max_step_tokens or lower max_batch")


@dataclass
class SequenceState:
    seq_id: int
    request_id: str
    token_ids: list[int]  # the prompt, then each generated token
    num_prompt: int
    num_cached: int = 0  # tokens already written to the KV slot
    slot: int = -1  # -1 while waiting
    is_cancelled: bool = False
    stops: tuple[int, ...] = ()  # ascending: prefill chunks end exactly there (state checkpoints are taken)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.num_prompt


@dataclass(frozen=True)
class ScheduledChunk:
    """Feed ``token_ids`` to sequence ``seq_id`` at positions start.. of its slot this step."""

    seq_id: int
    slot: int
    start: int
    token_ids: list[int]
    samples: bool  # the chunk ends at the last known token: sample the next one from its logits


@dataclass(frozen=True)
class StepPlan:
    chunks: list[ScheduledChunk]
    admitted: list[int]  # seq ids that took a slot in this schedule() call
    cancelled: list[int]  # running seq ids whose cancel was asked for: the caller finishes them

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class Cancelled:
    seq_id: int
    was_queued: bool  # True: removed from the queue now; False: marked, reported by the next schedule()


class Scheduler:
    def __init__(self, config: SchedulerConfig,
                 on_admit: Callable[[int, list[int]], int | None] | None = None,
                 stops: Callable[[int, list[int], int], tuple[int, ...]] | None = None) -> None:
        """``on_admit(seq_id, token_ids)``: called before a waiting sequence takes a slot; returns how many
        of its first tokens are already in the KV cache (a reused prefix, then not fed again), or None
        when the KV pool has no room for it now (it stays first in the queue). ``stops(seq_id, token_ids,
        cached)``: ascending positions its prefill chunks must end at, asked once it is admitted."""
        self._on_admit = on_admit
        self._stops = stops
        self.max_batch = config.max_batch
        self.max_queue = config.max_queue
        self.prefill_chunk = config.prefill_chunk
        self.max_step_tokens = config.max_step_tokens
        self._waiting: deque[SequenceState] = deque()
        self._running: dict[int, SequenceState] = {}  # admission order
        self._free_slots: list[int] = list(range(config.max_batch))  # ascending: low slots first
        self._by_request: dict[str, SequenceState] = {}
        self._next_seq_id = 0
        self.num_preempted = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def free_slots(self) -> list[int]:
        return list(self._free_slots)

    def running_ids(self) -> list[int]:
        return list(self._running)

    def add(self, request_id: str, prompt_ids: list[int]) -> int:
        """Queue a sequence; returns its seq id. Raises QueueFullError when max_queue are already waiting."""
        if request_id in self._by_request:
            raise InvalidRequestError(
                f"request_id {quoted(request_id)} is already queued or running; give each request a unique id")
        if len(self._waiting) >= self.max_queue:
            raise QueueFullError(
                f"{len(self._waiting)} requests are already waiting (max_queue={self.max_queue}); retry later")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        seq = SequenceState(self._next_seq_id, request_id, list(prompt_ids), len(prompt_ids))
        self._next_seq_id += 1
        self._waiting.append(seq)
        self._by_request[request_id] = seq
        return seq.seq_id

    def schedule(self) -> StepPlan:
        """Admit waiting sequences into free slots, then pick this step's chunks (decodes first)."""
        admitted = []
        while self._waiting and self._free_slots:
            seq = self._waiting[0]
            if self._on_admit is not None:
                cached = self._on_admit(seq.seq_id, seq.token_ids)
                if cached is None:
                    break  # no KV room now: it waits, first in line
                if not 0 <= cached < seq.num_prompt:
                    raise ValueError(f"on_admit: {cached} cached tokens for a prompt of {seq.num_prompt}")
                seq.num_cached = cached
            if self._stops is not None:
                seq.stops = tuple(self._stops(seq.seq_id, seq.token_ids, seq.num_cached))
            self._waiting.popleft()
            seq.slot = self._free_slots.pop(0)
            self._running[seq.seq_id] = seq
            admitted.append(seq.seq_id)
        cancelled = [s.seq_id for s in self._running.values() if s.is_cancelled]
        live = [s for s in self._running.values() if not s.is_cancelled and s.num_cached < len(s.token_ids)]
        chunks = [self._chunk(s, len(s.token_ids) - s.num_cached) for s in live if not s.is_prefilling]
        budget = self.max_step_tokens - len(chunks)
        for seq in live:
            if budget <= 0:
                break
            if seq.is_prefilling:
                n = min(self.prefill_chunk, len(seq.token_ids) - seq.num_cached, budget)
                stop = next((s for s in seq.stops if s > seq.num_cached), None)
                if stop is not None:
                    n = min(n, stop - seq.num_cached)
                chunks.append(self._chunk(seq, n))
                budget -= n
        return StepPlan(chunks, admitted, cancelled)

    @staticmethod
    def _chunk(seq: SequenceState, n: int) -> ScheduledChunk:
        end = seq.num_cached + n
        return ScheduledChunk(seq.seq_id, seq.slot, seq.num_cached, seq.token_ids[seq.num_cached:end],
                              samples=end == len(seq.token_ids))

    def record(self, seq_id: int, num_fed: int, new_token: int | None = None) -> None:
        """After a step: ``num_fed`` tokens are now in the slot; ``new_token`` was sampled (None while prefilling)."""
        seq = self._running[seq_id]
        seq.num_cached += num_fed
        if new_token is not None:
            seq.token_ids.append(new_token)

    def preempt(self, seq_id: int) -> None:
        """Take a running sequence out (its KV blocks are being given to others): it goes back to the front
        of the queue with every token it has, and prefills them all again when it is admitted next
        (from the prefix cache, mostly). Its request does not notice, except in time."""
        seq = self._running.pop(seq_id)
        self._free_slots.append(seq.slot)
        self._free_slots.sort()
        seq.slot, seq.num_cached, seq.num_prompt = -1, 0, len(seq.token_ids)
        self._waiting.appendleft(seq)
        self.num_preempted += 1

    def newest_running(self, exclude: set[int]) -> int | None:
        """The most recently admitted running sequence not in ``exclude`` (the one to preempt first)."""
        return next((s for s in reversed(self._running) if s not in exclude), None)

    def stops_of(self, seq_id: int) -> tuple[int, ...]:
        seq = self._running.get(seq_id)
        return () if seq is None else seq.stops

    def cached_token_ids(self, seq_id: int) -> list[int]:
        """The tokens of a running sequence whose K/V are in its blocks (empty for a waiting one)."""
        seq = self._running.get(seq_id)
        return [] if seq is None else seq.token_ids[: seq.num_cached]

    def finish(self, seq_id: int) -> bool:
        """Remove a sequence (running: its slot is free again; waiting: it leaves the queue). False if unknown."""
        seq = self._running.pop(seq_id, None)
        if seq is not None:
            self._free_slots.append(seq.slot)
            self._free_slots.sort()
        else:
            seq = next((s for s in self._waiting if s.seq_id == seq_id), None)
            if seq is None:
                return False
            self._waiting.remove(seq)
        del self._by_request[seq.request_id]
        return True

    def cancel(self, request_id: str) -> Cancelled | None:
        """A waiting sequence is removed now; a running one is marked and listed in the next plan's cancelled."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        if seq.seq_id in self._running:
            seq.is_cancelled = True
            return Cancelled(seq.seq_id, was_queued=False)
        self.finish(seq.seq_id)
        return Cancelled(seq.seq_id, was_queued=True)
