"""A generation request as plain data, the events streamed back for it, and the caller's handle on it."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from moed.engine.sampling import SamplingParams

# eos | stop | length | context | cancelled | deadline | error
FINISH_REASONS = ("eos", "stop", "length", "context", "cancelled", "deadline", "error")


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None = None  # a time.monotonic() instant; past it the request ends with "deadline"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # submit to first token (queue wait included: what the client sees)
    decode_tok_s: float  # tokens after the first / time from the first to the last
    seed: int  # the sampler's seed (drawn when the request gave none), to reproduce an output
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (their K/V reused, not prefilled)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the ``top`` alternatives (id, log-probability), most likely first:
    the log-softmax of the step's logits after the penalties, logit_bias and the grammar, before temperature
    and top-k / top-p / min-p (``SamplingParams.logprobs``)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StreamEvent:
    """One token (done=False), or the end of the stream (done=True, finish_reason and usage set).

    The text of every event, the done event included, concatenates to the full output; a token's
    text may be "" while a UTF-8 character or a possible stop string is still incomplete.
    """

    text: str
    token_ids: tuple[int, ...]
    done: bool
    finish_reason: str = ""
    usage: Usage | None = None
    error: str = ""  # set when finish_reason == "error"
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids, when the request asked for them


class RequestHandle:
    """The submitter's side of one request: a thread-safe event queue and a cancel button."""

    def __init__(self, request_id: str, cancel: Callable[[str], bool]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        self._consumed_done = False

    def push(self, event: StreamEvent) -> None:
        """Engine side: queue one event (any thread)."""
        self._events.put(event)

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Yield events as they arrive, ending after the done event.

        ``timeout`` bounds the wait for each event; when it passes, TimeoutError is raised (the
        request keeps running: cancel it if the caller gives up).
        """
        while not self._consumed_done:
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"request {self.request_id!r}: no event within {timeout} s; it is still queued or running"
                ) from None
            if event.done:
                self._consumed_done = True
            yield event

    def cancel(self) -> bool:
        """Ask the engine to stop this request; False when it already finished (or is unknown)."""
        return self._cancel(self.request_id)
