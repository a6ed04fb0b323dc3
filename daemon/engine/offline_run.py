"""Run a list of requests to completion on an in-process EngineLoop (`moed generate`, benchmarks, tests).

Every request is queued before the loop starts, so all of them (up to max_batch) enter the first
step together: a batch is a batch, not a race between threads. The loop is the daemon's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moed.engine.engine_loop import EngineLoop, step_sizes
from moed.engine.request import GenerationRequest, StreamEvent, Usage
from moed.engine.runtime import DEFAULT_CONTEXT, ModelRuntime
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError

EventCallback = Callable[[int, StreamEvent], None]  # (request index, event)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # one of request.FINISH_REASONS
    usage: Usage
    error: str = ""


def run_offline(runtime: ModelRuntime, prompts: list[list[int]], params: list[SamplingParams], *,
                context_length: int | None = None, max_batch: int | None = None,
                on_event: EventCallback | None = None) -> list[Completion]:
    """Generate for every prompt; returns one Completion per prompt, in order.

    ``context_length`` None: large enough for the longest prompt plus its ``max_tokens`` (at least
    DEFAULT_CONTEXT, at most the model's max_position_embeddings), so a long prompt runs without a flag.

    Ctrl-C (KeyboardInterrupt) cancels every request; their done events ("cancelled") still arrive
    and the completions are returned.
    """
    if not prompts or len(prompts) != len(params):
        raise InvalidRequestError("give at least one prompt and one SamplingParams per prompt")
    batch = max_batch or len(prompts)
    if context_length is None:
        need = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
        context_length = min(runtime.model.config.max_position_embeddings, max(DEFAULT_CONTEXT, need))
    loop = EngineLoop(runtime, name="offline", max_batch=batch, max_queue=len(prompts),
                      max_step_tokens=step_sizes(runtime, batch)[1], context_length=context_length)
    try:
        handles = [loop.submit(GenerationRequest(f"offline-{i}", list(p), sp))
                   for i, (p, sp) in enumerate(zip(prompts, params))]
        loop.start()
        results: list[Completion] = []
        for index, handle in enumerate(handles):
            tokens: list[int] = []
            text: list[str] = []
            final = _drain(handle, lambda e, i=index: _collect(i, e, tokens, text, on_event), handles)
            results.append(Completion(tokens, "".join(text), final.finish_reason, final.usage, final.error))
        return results
    finally:
        loop.stop(cancel_inflight=True)


def _collect(index: int, event: StreamEvent, tokens: list[int], text: list[str],
             on_event: EventCallback | None) -> None:
    tokens.extend(event.token_ids)
    text.append(event.text)
    if on_event is not None:
        on_event(index, event)


def _drain(handle, consume: Callable[[StreamEvent], None], all_handles) -> StreamEvent:
    events = handle.events()
    while True:
        try:
            for event in events:
                consume(event)
                if event.done:
                    return event
        except KeyboardInterrupt:
            for other in all_handles:  # the loop ends each at its next step with "cancelled"
                other.cancel()
            events = handle.events()
