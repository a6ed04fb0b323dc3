"""Mistral-style tool calls (Mixtral): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.

Grammar handled (Mixtral-8x22B-Instruct's template and Mistral's v3 tokenizer):

    text  [TOOL_CALLS] ws [ ws CALL (ws , ws CALL)* ws ] [text]        CALL = {"name": N, "arguments": {...}}

* ``[TOOL_CALLS]`` is a control token; one array holds all calls of the turn; keys other than
  name/arguments (e.g. "id") are ignored. The newer compact form ``[TOOL_CALLS]name[ARGS]{...}``
  (Mistral Small 3.2, Devstral) is not Mixtral's and is not parsed: it comes out as text.
* Tool-call ids are 9 alphanumeric characters: Mistral's chat templates refuse any other id
  when the call is sent back in the history.
* A malformed array sends the rest of the output, from the failing call on, out as text.
* ``</s>`` is the end-of-turn token and never text.
"""

from __future__ import annotations

import secrets
import string

from moed.text.output_parsers.base import OutputParser, PendingCall
from moed.text.output_parsers.call_object import CallObject

TOOL_CALLS = "[TOOL_CALLS]"
_ID_ALPHABET = string.ascii_letters + string.digits
# array state -> the punctuation it accepts next (after optional whitespace)
_EXPECT = {"array_open": "[", "first": "{]", "next": ",]", "element": "{"}


class MistralParser(OutputParser):
    tool_format = "mistral"
    end_tokens = ("</s>",)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._state = "text"  # text | array_open | first | next | element | object | skip
        self._call: PendingCall | None = None
        self._object: CallObject | None = None

    def _new_tool_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def _body_step(self, final: bool) -> bool:
        state = self._state
        if state == "text":
            progressed, marker = self._text_step((TOOL_CALLS,), final)
            if marker == TOOL_CALLS:
                self._call = PendingCall(raw=marker)
                self._state = "array_open"
            return progressed
        call = self._call
        if state == "skip":
            junk, marker = self._take_until(self.end_tokens, final)
            call.raw += junk
            if marker is None:
                return bool(junk)
            self._fail_call(call)
            self._call, self._state = None, "text"
            return True
        if state == "object":
            end = self._read_call(call, self._object.feed)
            if end is None:
                self._state = "skip"
                return True
            if self._object.done:
                self._end_call(call)
                self._call, self._state = PendingCall(), "next"
            return end > 0
        # array punctuation
        body = self._take_space(call)
        if not body:
            return False
        ch = body[0]
        if ch not in _EXPECT[state]:
            self._state = "skip"
            return True
        if ch == "{":
            self._object = CallObject(call)
            self._state = "object"
            return True
        self._buf = body[1:]
        if ch == "]":
            self._call, self._state = None, "text"  # the pending call holds only punctuation: dropped
            self._strip_text = True
        else:
            call.raw += ch
            self._state = "first" if ch == "[" else "element"
        return True

    def _finish_body(self) -> None:
        if self._call is None:
            return
        self._call.raw += self._buf
        if self._state == "object":
            self._end_call(self._call)  # complete if only the closing "]" is missing
        elif self._state == "next":
            pass  # "[{...}" complete calls and no closing "]": nothing left to say
        else:
            self._fail_call(self._call)
        self._call = None
