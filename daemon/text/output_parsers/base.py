"""The output-parser base: events, tool calls, marker scanning, `<think>` reasoning and call emission.

A family's parser turns the model's output text (special tokens kept, in any delta split) into
text, reasoning and tool-call events. The base class holds what every family shares:

* the buffer and ``_take_until``, which takes text up to the earliest marker and otherwise holds
  back only a tail that is a prefix of a marker (``<tool`` waits for the next delta; ``a < b`` goes
  out at once); ``_text_step`` emits text that way up to a family's call markers or end tokens;
* the optional ``<think>...</think>`` prologue (``think_tags``), including outputs that start
  inside reasoning because the prompt opened it;
* ``PendingCall``: one tool call being read, and the rules for when its events go out;
  ``_read_call`` feeds the buffer to a call's reader and emits what may go out.

Tool-call rules (the same for every family):

* The first event of a call carries ``tool_index``, ``tool_id`` and ``name`` and no arguments;
  the following ones carry pieces of the arguments JSON text, exactly as the model wrote it
  (leading/trailing whitespace dropped). The pieces concatenate to ``ToolCall.arguments``.
* With ``stream_arguments`` (default) a call's first event goes out once its name is known and
  its arguments have got past their first key (``{"city"``) or are complete; every piece has
  passed an incremental JSON check, so the concatenation is always a valid prefix. Without it, a
  call goes out whole when its arguments are complete.
* A call is complete when its arguments are a complete JSON object; the closing marker may be
  missing (generation stopped on a stop token). Complete calls are in ``tool_calls``.
* A call whose JSON is malformed, that names a tool not in ``tool_names``, or that is unfinished
  at ``finish()`` is a failed call. If none of its events went out, its block is emitted as
  text, exactly as written (markers included), so nothing the model wrote is lost. If its first
  event already went out (streaming, and the JSON broke later or generation stopped mid-call),
  it cannot be recalled: it goes to ``incomplete_tool_calls`` with the arguments already sent,
  and the rest of its block is dropped.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moed.text.output_parsers.json_stream import JsonStream, JsonSyntaxError


@dataclass(frozen=True)
class OutputEvent:
    kind: str  # "text" | "reasoning" | "tool_call"
    text: str = ""  # text / reasoning delta
    tool_index: int = -1  # 0, 1, ... per tool call in this response
    tool_id: str = ""  # e.g. "call_" + 24 hex chars, stable across a call's events
    name: str = ""  # function name, on the first event of a call (and only there)
    arguments_delta: str = ""  # a piece of the call's JSON arguments text


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON object text, as the model wrote it


class PendingCall:
    """One tool call being read: its name once known, its arguments checked as they arrive."""

    def __init__(self, raw: str = "", name: str | None = None) -> None:
        self.raw = raw  # the call's block as written, for the text fallback
        self.name = name
        self.args = JsonStream(require_object=True)
        self.args_text = ""
        self.sent = 0  # chars of args_text already emitted
        self.index = -1  # set when the first event goes out
        self.id = ""
        self.is_rejected = False  # names a tool the request did not offer

    @property
    def is_started(self) -> bool:
        return self.index >= 0

    @property
    def is_complete(self) -> bool:
        return self.name is not None and not self.is_rejected and self.args.done

    def add_args(self, text: str, start: int = 0) -> int:
        """Check text[start:] as arguments; the index after the last char that belongs to them.

        Raises JsonSyntaxError when the arguments are not a JSON object."""
        end = self.args.feed(text, start)
        chunk = text[start:end]
        self.args_text += chunk if self.args_text else chunk.lstrip()
        return end


def partial_marker_len(buf: str, markers: Sequence[str]) -> int:
    """The length of the longest tail of buf that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


class OutputParser:
    """Base class: feed() output deltas, get events; finish() at the end of generation.

    Subclasses implement ``_body_step`` (consume some of ``self._buf``; True when it made
    progress) and ``_finish_body`` (flush an open block at the end).
    """

    tool_format = ""  # the name moed.text.output_parser knows it by
    end_tokens: tuple[str, ...] = ()  # end-of-turn tokens: never text, dropped where they appear
    think_tags: tuple[str, str] | None = None  # ("<think>", "</think>") for families that reason in tags

    def __init__(self, *, tools: bool = True, reasoning: bool = True, starts_in_reasoning: bool = False,
                 tool_names: Collection[str] | None = None, stream_arguments: bool = True,
                 tool_parameters: Mapping[str, Any] | None = None) -> None:
        self.tools = tools
        self.reasoning = reasoning  # False: reasoning is parsed but not emitted
        self.starts_in_reasoning = starts_in_reasoning
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self.stream_arguments = stream_arguments
        self.tool_parameters = dict(tool_parameters or {})  # tool name -> JSON schema of its parameters
        self.tool_calls: list[ToolCall] = []
        self.incomplete_tool_calls: list[ToolCall] = []
        self.saw_tool_call = False  # a tool_call event went out
        self._buf = ""
        self._events: list[OutputEvent] = []
        self._is_finished = False
        self._strip_text = False  # drop whitespace at the start of the next text (after </think>, a call)
        self._strip_reasoning = False
        self._num_started = 0
        self._phase = "think_start" if self.think_tags else "body"

    # -- public ---------------------------------------------------------------------------------
    def feed(self, delta: str) -> list[OutputEvent]:
        """Events for this delta; text that could still start a marker is held for the next one."""
        if self._is_finished:
            raise RuntimeError("feed() after finish(): an output parser reads one response")
        self._buf += delta
        self._run(final=False)
        return self._take()

    def finish(self) -> list[OutputEvent]:
        """End of generation: release what was held and close an open block (see the module doc)."""
        if self._is_finished:
            return []
        self._run(final=True)
        self._finish_body()
        self._buf = ""
        self._is_finished = True
        return self._take()

    # -- driver ---------------------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        while True:
            if self._phase == "think_start":
                progressed = self._think_start(final)
            elif self._phase == "reasoning":
                progressed = self._reasoning_step(final)
            else:
                progressed = self._body_step(final)
            if not progressed:
                return

    def _body_step(self, final: bool) -> bool:
        raise NotImplementedError

    def _finish_body(self) -> None:
        raise NotImplementedError

    def _take(self) -> list[OutputEvent]:
        events, self._events = self._events, []
        return events

    # -- reasoning prologue ---------------------------------------------------------------------
    def _think_start(self, final: bool) -> bool:
        open_tag = self.think_tags[0]
        stripped = self._buf.lstrip()
        if stripped.startswith(open_tag):
            self._buf = stripped[len(open_tag):]
        elif not final and open_tag.startswith(stripped):
            return False  # empty, whitespace, or a prefix of <think>: wait
        elif not self.starts_in_reasoning:
            self._phase = "body"
            return True
        self._phase = "reasoning"
        self._strip_reasoning = True
        return True

    def _reasoning_step(self, final: bool) -> bool:
        close_tag = self.think_tags[1]
        reasoning, marker = self._take_until((close_tag, *self.end_tokens), final)
        self._emit_reasoning(reasoning)
        if marker == close_tag:
            self._phase = "body"
            self._strip_text = True
        return marker is not None or bool(reasoning)

    # -- helpers for subclasses ------------------------------------------------------------------
    def _take_until(self, markers: Sequence[str], final: bool) -> tuple[str, str | None]:
        """Take the text before the earliest marker and the marker off the buffer: (text, marker).

        With no marker in the buffer only what cannot start one is taken (all of it when final),
        and the marker is None."""
        buf = self._buf
        cut, marker = -1, None
        for m in markers:
            i = buf.find(m)
            if i != -1 and (cut == -1 or i < cut):
                cut, marker = i, m
        if marker is None:
            cut = len(buf) if final else len(buf) - partial_marker_len(buf, markers)
        self._buf = buf[cut + len(marker or ""):]
        return buf[:cut], marker

    def _text_step(self, call_markers: Sequence[str], final: bool) -> tuple[bool, str | None]:
        """Emit text up to a marker: one of call_markers (looked for only when tools were offered) or an end token.

        (progressed, the marker taken off the buffer or None); the caller goes where the marker leads."""
        text, marker = self._take_until((*call_markers, *self.end_tokens) if self.tools else self.end_tokens, final)
        self._emit_text(text)
        return marker is not None or bool(text), marker

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        last = self._events[-1] if self._events else None
        if last is not None and last.kind == kind:
            self._events[-1] = OutputEvent(kind=kind, text=last.text + text)
        else:
            self._events.append(OutputEvent(kind=kind, text=text))

    def _emit_text(self, text: str) -> None:
        if self._strip_text:
            text = text.lstrip()
            self._strip_text = not text  # all whitespace: keep stripping the next text
        self._emit("text", text)

    def _emit_reasoning(self, text: str) -> None:
        if self._strip_reasoning:
            text = text.lstrip()
            self._strip_reasoning = not text
        if self.reasoning:
            self._emit("reasoning", text)

    def _new_tool_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    # -- tool calls -----------------------------------------------------------------------------
    def _take_space(self, call: PendingCall) -> str:
        """Move the buffer's leading whitespace into the call's block; what is left of the buffer."""
        body = self._buf.lstrip()
        call.raw += self._buf[:len(self._buf) - len(body)]
        self._buf = body
        return body

    def _read_call(self, call: PendingCall, feed: Callable[[str], int]) -> int | None:
        """Feed the buffer to the call's reader (``feed`` returns how far it read); what it read
        moves into ``call.raw`` and what may go out is emitted.

        The number of chars read, or None when the call is malformed (the buffer is left as it was)."""
        try:
            end = feed(self._buf)
        except JsonSyntaxError:
            return None
        call.raw += self._buf[:end]
        self._buf = self._buf[end:]
        self._flush_call(call)
        return end

    def _flush_call(self, call: PendingCall) -> None:
        """Emit what of the call may go out now (see the module doc)."""
        if call.is_rejected or call.name is None:
            return
        if not call.is_started:
            ready = call.args.done or (self.stream_arguments and call.args.top_keys > 0)
            if not ready:
                return
            if self.tool_names is not None and call.name not in self.tool_names:
                call.is_rejected = True
                return
            call.index, call.id = self._num_started, self._new_tool_id()
            self._num_started += 1
            self.saw_tool_call = True
            self._events.append(OutputEvent(kind="tool_call", tool_index=call.index, tool_id=call.id, name=call.name))
        piece = call.args_text[call.sent:]
        if not piece or (not self.stream_arguments and not call.args.done):
            return
        call.sent = len(call.args_text)
        last = self._events[-1] if self._events else None
        if last is not None and last.kind == "tool_call" and last.tool_index == call.index and not last.name:
            piece = last.arguments_delta + piece
            self._events.pop()
        self._events.append(OutputEvent(kind="tool_call", tool_index=call.index, tool_id=call.id,
                                        arguments_delta=piece))

    def _end_call(self, call: PendingCall) -> None:
        """The call's block ended (closing marker, or end of output): complete it or fail it."""
        if call.is_complete:
            self._flush_call(call)
        if call.is_complete and call.is_started:
            self.tool_calls.append(ToolCall(call.index, call.id, call.name, call.args_text))
        else:
            self._fail_call(call)

    def _fail_call(self, call: PendingCall) -> None:
        if call.is_started:
            self.incomplete_tool_calls.append(ToolCall(call.index, call.id, call.name or "",
                                                       call.args_text[:call.sent]))
        else:
            self._emit_text(call.raw)
