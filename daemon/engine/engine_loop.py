"""EngineLoop: one thread serving many requests on one model by continuous batching over one KV cache.

Each step: finish expired and cancelled sequences, take the scheduler's plan (engine/scheduler.py:
admission, chunking, preemption order), grow the sequences' block tables (preempting when the pool
runs dry), run one ForwardBatch holding every scheduled prefill chunk and decode token, then let each
request sample, detokenize and stream (engine/live_request.py); a hybrid model's prefill stops and
state snapshots are engine/hybrid_checkpoints.py's. A failed step fails only its own sequences.
Other threads only submit, cancel, read figures and queue safe-point functions; the model, the cache
and the per-request samplers/decoders are touched by the loop thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import torch

from moed.cache.kv_cache import DEFAULT_BLOCK_SIZE
from moed.engine.hybrid_checkpoints import HybridCheckpoints, boundary_ids
from moed.engine.kv_manager import KVFigures, KVManager, kv_pool_tokens
from moed.engine.live_request import LiveRequest
from moed.engine.request import GenerationRequest, RequestHandle
from moed.engine.runtime import DEFAULT_CONTEXT, ModelRuntime
from moed.engine.sampling import SamplingParams
from moed.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from moed.engine.step_execution import grant_blocks, run_forward
from moed.engine.step_outcome import record_outcomes, sample_outcomes
from moed.engine.step_workspace import step_workspace_bytes
from moed.errors import InvalidRequestError, quoted

log = logging.getLogger(__name__)

RATE_WINDOW_S = 5.0  # tokens_per_second looks this far back
MAX_REQUEST_ID_CHARS = 256  # every response carries it back
DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per sequence per step (see docs/benchmarks.md: 256 -> 512 gave +20-40% prefill on Zen 3)
DEFAULT_MAX_STEP_TOKENS = 1024  # tokens per step, all sequences together
# With the model on a device a long prefill streams the whole expert pool over the link once per
# step (experts/prefill_stream.py), so a step must carry thousands of tokens to hide it (the paper:
# 8192-token chunks); attention runs there too, so the activations live in VRAM.
DEVICE_PREFILL_CHUNK = 4096
DEVICE_MAX_STEP_TOKENS = 8192


def step_sizes(runtime: ModelRuntime, batch: int = 1) -> tuple[int, int]:
    """(prompt tokens per sequence per step, tokens per step) for this runtime: larger on a device."""
    if getattr(runtime.model, "device", None) is not None:
        return DEVICE_PREFILL_CHUNK, max(DEVICE_MAX_STEP_TOKENS, DEVICE_PREFILL_CHUNK * batch)
    return DEFAULT_PREFILL_CHUNK, max(DEFAULT_MAX_STEP_TOKENS, DEFAULT_PREFILL_CHUNK * batch)


class EngineLoop:
    def __init__(self, runtime: ModelRuntime, *, name: str, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int | None = None, max_step_tokens: int | None = None,
                 context_length: int | None = None, prefix_cache: bool = True, kv_tokens: int | None = None,
                 checkpoint_bytes: int = 1 << 30) -> None:
        """``prefill_chunk`` / ``max_step_tokens``: None takes ``step_sizes(runtime)`` (the CPU's 512 /
        1024, or 4096 / 8192 with the model on a device). ``prefix_cache``: reuse the K/V of earlier
        requests' common prefixes (engine/kv_manager.py). ``kv_tokens``: the KV pool's size in tokens
        (None: ``kv_pool_tokens``'s default, two whole contexts). ``checkpoint_bytes``: a hybrid model's
        recurrent-state checkpoints kept for prefix reuse (LRU)."""
        default_chunk, default_step = step_sizes(runtime)
        prefill_chunk = default_chunk if prefill_chunk is None else prefill_chunk
        max_step_tokens = default_step if max_step_tokens is None else max_step_tokens
        config = runtime.model.config
        max_pos = config.max_position_embeddings
        context = min(DEFAULT_CONTEXT, max_pos) if context_length is None else context_length
        if context < 2:
            raise InvalidRequestError(f"{name}: context length must be at least 2 tokens, got {context}")
        if context > max_pos:
            raise InvalidRequestError(
                f"{name}: context length {context} exceeds the model's max_position_embeddings ({max_pos})")
        self.name = name
        self.runtime = runtime
        self.context_length = context
        self.max_batch = max_batch
        # the KV pool, shared by the running sequences through block tables; what they leave free holds
        # earlier requests' prefixes until it is needed. A sequence is admitted when the pool can hold
        # its prompt; one that cannot grow is preempted (engine/kv_manager.py, Scheduler.preempt)
        num_blocks = kv_pool_tokens(context, max_batch, kv_tokens) // DEFAULT_BLOCK_SIZE
        # a hybrid model's linear layers cannot resume from K/V alone: its prefixes are reused only up
        # to a recurrent-state checkpoint, taken at the semantic boundaries of each new prompt (after
        # every end-of-message token: ends of turns, tool calls, tool outputs; and where the prompt
        # ends), snapped down to a block
        recurrent = bool(getattr(runtime.model, "has_recurrent_state", False))
        self._kv = KVManager(num_blocks, DEFAULT_BLOCK_SIZE, prefix_cache=prefix_cache, checkpoints=recurrent,
                             checkpoint_bytes=checkpoint_bytes)
        self._preempted: set[int] = set()  # seq ids waiting to come back
        self.kv_full_blocks = num_blocks  # the pool's configured size (a memory budget may hold it lower)
        self._context_blocks = -(-context // DEFAULT_BLOCK_SIZE)
        self._scheduler = Scheduler(SchedulerConfig(max_batch, max_queue, prefill_chunk, max_step_tokens),
                                    on_admit=self._on_admit, stops=lambda *a: self._checkpoints.stops(*a))
        self._vocab_size = config.vocab_size
        eos = set(config.eos_token_ids)
        if runtime.tokenizer is not None:
            eos |= set(runtime.tokenizer.eos_token_ids)
        self._eos_ids = frozenset(eos)
        # hybrid models: prefill stops and recurrent-state snapshots at semantic boundaries
        # (DeepSeek-V4 snaps them to a multiple of its largest compression ratio: checkpoint_granularity)
        self._checkpoints = HybridCheckpoints(self._kv, self._scheduler, boundary_ids(runtime.tokenizer, eos),
                                              getattr(runtime.model, "checkpoint_granularity", DEFAULT_BLOCK_SIZE))
        self._cache = (runtime.model.new_pool(num_blocks, DEFAULT_BLOCK_SIZE, state_slots=max_batch) if recurrent
                       else runtime.model.new_pool(num_blocks, DEFAULT_BLOCK_SIZE))

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._live: dict[int, LiveRequest] = {}  # seq id -> request state (queued and running)
        self._safe_points: list[tuple[Callable[[], Any], Future]] = []
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stopping = False
        self._rate: deque[tuple[float, int]] = deque()  # (step end, tokens sampled)

        self.requests_served = 0  # requests that got their done event, whatever the reason
        self.num_steps = 0
        self.max_batch_seen = 0  # most sequences in one step (continuous batching at work)
        self.last_error = ""

    # ---- public API (any thread) ----

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"engine loop {self.name!r} was already started")
            self._thread = threading.Thread(target=self._run, name=f"moed-engine-{self.name}", daemon=True)
            self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Validate and queue; raises InvalidRequestError or QueueFullError without queueing anything."""
        self._validate(request)
        handle = RequestHandle(request.request_id, self.cancel)
        live = LiveRequest.create(request, handle, self.runtime.tokenizer,
                                  self._constraint_for if self.runtime.tokenizer is not None else None)
        with self._wakeup:
            if not self._accepting:
                raise InvalidRequestError("the daemon is shutting down")
            seq_id = self._scheduler.add(request.request_id, request.prompt_ids)
            self._live[seq_id] = live
            self._wakeup.notify_all()
        return handle

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued (ends now) or running (ends at the next step boundary) request; False if unknown."""
        with self._wakeup:
            found = self._scheduler.cancel(request_id)
            if found is None:
                return False
            if found.was_queued:
                self._finish_locked(found.seq_id, "cancelled")
            self._wakeup.notify_all()
            return True

    def run_at_safe_point(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the loop thread between two steps (no forward in flight); its result lands in the future.

        Before start() and after stop() no step can run, so fn runs at once in the calling thread.
        """
        future: Future = Future()
        with self._wakeup:
            if self._thread is not None and self._thread.is_alive() and not self._stopped_locked():
                self._safe_points.append((fn, future))
                self._wakeup.notify_all()
                return future
        _run_into(fn, future)
        return future

    def stop(self, cancel_inflight: bool = True, timeout: float = 30.0) -> bool:
        """Refuse new requests; cancel (or, with cancel_inflight=False, finish) running and queued ones; join.

        Returns True when the loop thread has ended within timeout.
        """
        with self._wakeup:
            self._accepting = False
            started = self._thread is not None
            if cancel_inflight or not started:  # never started: nothing would ever drain the queue
                for live in list(self._live.values()):
                    found = self._scheduler.cancel(live.request.request_id)
                    if found is not None and found.was_queued:
                        self._finish_locked(found.seq_id, "cancelled")
            self._stopping = True
            self._wakeup.notify_all()
            thread = self._thread
        if thread is None:
            self._cache = None
            return True
        thread.join(timeout)
        return not thread.is_alive()

    @property
    def num_active(self) -> int:
        with self._lock:
            return self._scheduler.num_running

    @property
    def num_queued(self) -> int:
        with self._lock:
            return self._scheduler.num_waiting

    @property
    def state(self) -> str:
        with self._lock:
            busy = self._scheduler.num_running or self._scheduler.num_waiting
        return "generating" if busy else "idle"

    def kv_figures(self) -> KVFigures:
        """The KV pool's blocks and the prefix cache's hits so far."""
        with self._lock:
            figures = self._kv.figures()
            figures.preempted = self._scheduler.num_preempted
        cache = self._cache
        nbytes = getattr(cache, "nbytes", None)
        figures.pool_bytes = nbytes() if nbytes is not None else 0
        return figures

    def kv_block_bytes(self) -> int:
        """Bytes of one block of the pool (every layer's entries)."""
        cache = self._cache
        num = getattr(cache, "num_blocks", 0)
        return cache.nbytes() // num if num else 0

    def state_bytes(self) -> int:
        """A hybrid model's recurrent states (one per batch row) plus its checkpoint budget: they sit next to
        the KV pool (on the device with it) and come out of the same share; 0 for other models."""
        cache = self._cache
        states = cache.state_nbytes() if cache is not None and hasattr(cache, "state_nbytes") else 0
        return states + (self._kv.checkpoint_budget if self._kv.checkpoints else 0)

    def workspace_bytes(self) -> int:
        """The activations of this loop's largest step on the model's device (engine/step_workspace.py): they
        come out of the device share before the KV pool and the expert cache; 0 with the model on the host
        (the load plan booked the host's)."""
        device = getattr(self.runtime.model, "device", None)
        if device is None:
            return 0
        device_type = device.to_device(torch.zeros(1)).device.type  # "cpu" for the emulated device
        return step_workspace_bytes(self.runtime.model.config, self._scheduler.max_step_tokens,
                                    sequences=self.max_batch, device_type=device_type)

    def kv_floor_blocks(self) -> int:
        """The fewest blocks the pool may shrink to: those running sequences hold, and one whole context."""
        with self._lock:
            held = self._kv.blocks_in_use()
        return min(self.kv_full_blocks, max(self._context_blocks, held))

    @property
    def kv_num_blocks(self) -> int:
        return self._kv.num_blocks

    def resize_kv(self, num_blocks: int) -> Future:
        """Resize the KV pool at the next safe point, between kv_floor_blocks() and kv_full_blocks (cached
        prefixes are evicted first, blocks still held are moved below the new size); the future's
        result: the new size in blocks."""
        return self.run_at_safe_point(lambda: self._resize_kv(num_blocks))

    def _resize_kv(self, num_blocks: int) -> int:
        num_blocks = max(min(int(num_blocks), self.kv_full_blocks), self.kv_floor_blocks())
        if num_blocks == self._kv.num_blocks or self._cache is None:
            return self._kv.num_blocks
        with self._lock:
            moves = self._kv.resize(num_blocks)
        self._cache = self.runtime.model.resize_pool(self._cache, num_blocks, moves)
        return num_blocks

    def clear_prefix_cache(self) -> Future:
        """Drop every cached prefix at the next safe point (the future's result: blocks freed)."""
        return self.run_at_safe_point(self._kv.clear_cache)

    @property
    def tokens_per_second(self) -> float:
        """Tokens sampled per second over the last RATE_WINDOW_S seconds (decays to 0 when idle)."""
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._rate if t >= now - RATE_WINDOW_S]
        if len(recent) < 2 or now <= recent[0][0]:
            return 0.0
        return sum(n for _, n in recent[1:]) / (now - recent[0][0])

    # ---- the loop thread ----

    def _stopped_locked(self) -> bool:
        return self._stopping and not self._scheduler.num_running and not self._scheduler.num_waiting

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while (not self._safe_points and not self._scheduler.num_running
                       and not self._scheduler.num_waiting and not self._stopping):
                    self._wakeup.wait()
                safe_points, self._safe_points = self._safe_points, []
                exiting = self._stopped_locked() and not safe_points
            for fn, future in safe_points:
                _run_into(fn, future)
            if exiting:
                break
            try:
                self._step()
            except Exception as exc:  # a bug outside the model call: fail what is running, keep serving
                log.exception("engine %s: step failed", self.name)
                with self._lock:
                    running = self._scheduler.running_ids()
                self._fail(running, f"engine step failed: {type(exc).__name__}: {exc}")
        with self._lock:
            self._cache = None  # the KV memory goes with the loop
            for fn, future in self._safe_points:  # queued while we were exiting
                _run_into(fn, future)
            self._safe_points = []

    def _step(self) -> None:
        """One step: plan (under the lock), blocks and forward (engine/step_execution.py), outcome
        (engine/step_outcome.py). A failed forward fails the step's own sequences and nothing else."""
        chunks = self._plan()
        if not chunks:
            return
        # blocks first: a sequence preempted here goes back to the queue and is not part of this step,
        # so a failure of the forward below is not its failure
        ready = grant_blocks(chunks, self._kv, self._scheduler, self._lock, self._preempted)
        if not ready:
            return
        chunks = [c for c, _ in ready]
        try:
            logits = run_forward(self.runtime.model, self._cache, self._checkpoints, ready)  # [B, V]
        except Exception as exc:
            log.exception("engine %s: model step failed", self.name)
            self._fail([c.seq_id for c in chunks], f"model step failed: {type(exc).__name__}: {exc}")
            return
        self.num_steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(chunks))
        outcomes = sample_outcomes(chunks, logits, self._live, self._eos_ids, self.context_length, name=self.name)
        del logits
        with self._lock:
            for o in record_outcomes(outcomes, self._scheduler, self._kv, self._checkpoints, self._cache):
                if o.error:
                    self.last_error = o.error
                self._finish_locked(o.chunk.seq_id, o.reason, o.error)
            now = time.monotonic()
            self._rate.append((now, sum(1 for o in outcomes if o.token is not None)))
            while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
                self._rate.popleft()

    def _plan(self) -> list[ScheduledChunk]:
        """Finish expired and cancelled sequences, then the scheduler's chunks for this step."""
        now = time.monotonic()
        with self._lock:
            expired = [seq_id for seq_id, live in self._live.items()
                       if live.request.deadline is not None and now > live.request.deadline]
            for seq_id in expired:
                self._finish_locked(seq_id, "deadline")
            plan = self._scheduler.schedule()
            for seq_id in plan.cancelled:
                self._finish_locked(seq_id, "cancelled")
            return [c for c in plan.chunks if c.seq_id in self._live]

    def _fail(self, seq_ids: list[int], message: str) -> None:
        """End these sequences with an error (a failed step: its K/V blocks are not cached)."""
        with self._lock:
            self.last_error = message
            for seq_id in seq_ids:
                self._finish_locked(seq_id, "error", message)

    def _on_admit(self, seq_id: int, token_ids: list[int]) -> int | None:
        """The scheduler's admission hook (under the lock): KV room and the cached prefix of a sequence."""
        resumed = seq_id in self._preempted
        cached = self._kv.admit(seq_id, token_ids, alone=self._scheduler.num_running == 0, resumed=resumed)
        if cached is not None:
            self._preempted.discard(seq_id)
            live = self._live.get(seq_id)
            if live is not None and not resumed:
                live.cached_tokens = cached
        return cached

    # ---- shared (caller holds the lock) ----

    def _finish_locked(self, seq_id: int, reason: str, error: str = "") -> None:
        """End a request: flush held-back text, free its slot, drop every reference to its state, send done."""
        live = self._live.pop(seq_id, None)
        self._preempted.discard(seq_id)
        # the blocks of a sequence whose step failed may hold half-written K/V: not cached then
        self._kv.release(seq_id, None if reason == "error" else self._scheduler.cached_token_ids(seq_id))
        self._scheduler.finish(seq_id)
        if live is None:
            return
        live.handle.push(live.done_event(reason, error))
        self.requests_served += 1

    def _constraint_for(self, grammar):
        """The matcher of a request's grammar on this model's tokenizer (text/grammar.py)."""
        from moed.text.grammar import grammar_tokenizer

        return grammar_tokenizer(self.runtime.tokenizer, self._vocab_size, self._eos_ids).constraint(grammar)

    def _validate(self, request: GenerationRequest) -> None:
        if not isinstance(request.request_id, str) or not request.request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id has {len(request.request_id)} characters; "
                                      f"at most {MAX_REQUEST_ID_CHARS} are allowed")
        if not isinstance(request.params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(request.params).__name__}")
        prompt = request.prompt_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty; give at least one token of text")
        if len(prompt) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens but model {self.name!r} serves a context of "
                f"{self.context_length} (prompt plus at least one generated token); shorten the prompt")
        vocab = self._vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {quoted(bad[0])} is outside the model's vocabulary (0..{vocab - 1})")


def _run_into(fn: Callable[[], Any], future: Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
        future.set_exception(exc)
