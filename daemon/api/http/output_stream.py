"""A generation stream run through the model family's output parser: text, reasoning and tool-call events.

``parsed_events`` turns the engine's token deltas into the parser's ``OutputEvent``s (kind "text",
"reasoning" or "tool_call"; see ``moed.text.output_parser``) and ends with one ``Finished``;
``OutputCollector`` adds them up for a non-streamed answer. Every API's serving module (OpenAI
chat / responses, Anthropic messages) maps these to its own wire format.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from moed.api.http.bridge import GenerationStream
from moed.engine.request import TokenLogprob, Usage
from moed.text.output_parser import OutputEvent, OutputParser


@dataclass(frozen=True)
class Finished:
    """The end of a parsed stream: the engine's finish reason, usage and (reason "error") the error."""

    reason: str
    usage: Usage | None
    error: str = ""
    has_tool_calls: bool = False


@dataclass(frozen=True)
class Logprobs:
    """The log-probabilities of the tokens of one engine event (only when ``parsed_events(logprobs=True)``)."""

    entries: tuple[TokenLogprob, ...]


@dataclass
class ToolCallSoFar:
    index: int
    id: str
    name: str = ""
    arguments: str = ""


async def parsed_events(stream: GenerationStream, parser: OutputParser, *, heartbeat_s: float | None = None,
                        is_disconnected: Callable[[], Awaitable[bool]] | None = None, logprobs: bool = False,
                        ) -> AsyncIterator[OutputEvent | Finished | Logprobs | None]:
    """Yield the parser's OutputEvents, ``None`` at heartbeats (see ``GenerationStream.events``),
    and finally one ``Finished``; with ``logprobs``, each engine event's token log-probabilities as one
    ``Logprobs`` after its parsed events. Open the stream with ``raw=True``: the parsers read special tokens."""
    has_tool_calls = False
    events = stream.events(heartbeat_s=heartbeat_s, is_disconnected=is_disconnected)
    async with contextlib.aclosing(events):
        async for event in events:
            if event is None:
                yield None
                continue
            parsed = parser.feed(event.text) if event.text else []
            if event.done and event.finish_reason != "error":
                parsed += parser.finish()
            for out in parsed:
                has_tool_calls = has_tool_calls or out.kind == "tool_call"
                yield out
            if logprobs and event.logprobs:
                yield Logprobs(event.logprobs)
            if event.done:
                yield Finished(event.finish_reason, event.usage, event.error, has_tool_calls)


@dataclass
class OutputCollector:
    """A whole answer from parsed events: text, reasoning, tool calls in order."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallSoFar] = field(default_factory=list)
    finished: Finished | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, event: OutputEvent | Finished | Logprobs | None) -> None:
        if event is None:
            return
        if isinstance(event, Logprobs):
            self.logprobs.extend(event.entries)
        elif isinstance(event, Finished):
            self.finished = event
        elif event.kind == "text":
            self.text += event.text
        elif event.kind == "reasoning":
            self.reasoning += event.text
        elif event.kind == "tool_call":
            call = next((c for c in self.tool_calls if c.index == event.tool_index), None)
            if call is None:
                call = ToolCallSoFar(event.tool_index, event.tool_id)
                self.tool_calls.append(call)
            call.name = event.name or call.name
            call.arguments += event.arguments_delta
