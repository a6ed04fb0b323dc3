"""GLM-4.5 / 4.6 / 4.7 and GLM-5 tool calls (`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...`)
and `<think>` reasoning.

Grammar handled (GLM's chat templates ask for exactly this; GLM-4.5 puts a newline after the name and
between the pairs, GLM-4.7 and GLM-5 write them back to back)::

    [<think> reasoning </think>]  text  (<tool_call> NAME ws (<arg_key>K</arg_key> ws <arg_value>V</arg_value> ws)*
                                         </tool_call> ws)*  [text]

* Values are written raw: a string as its text, anything else as JSON (the templates render non-string
  arguments with ``tojson``). A value is typed by the tool's schema (``tool_parameters``) when the parameter
  is there (``xml_call.convert_value``); otherwise it is JSON when it parses as JSON, else the text.
* The arguments stream one ``"key": value`` piece per pair; a call is complete at ``</tool_call>``.
* With ``starts_in_reasoning`` (GLM-4.7 / GLM-5 open ``<think>`` in the prompt) the output begins inside reasoning.
* ``<|user|>``, ``<|observation|>`` and ``<|endoftext|>`` end the turn and are never text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from moed.text.output_parsers.base import OutputParser, PendingCall
from moed.text.output_parsers.json_stream import JsonSyntaxError
from moed.text.output_parsers.xml_call import ParamCall, convert_value

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
END_TOKENS = ("<|user|>", "<|observation|>", "<|endoftext|>")


def typed_value(raw: str, schema: Any) -> Any:
    """A raw argument value as JSON: by its schema type when there is one, else JSON if it parses."""
    if isinstance(schema, Mapping) and schema.get("type") is not None:
        return convert_value(raw, schema)
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class ArgKeyCall(ParamCall):
    """Reads one GLM call after ``<tool_call>`` up to and including ``</tool_call>``; ``feed`` returns how far."""

    def __init__(self, call: PendingCall, tool_parameters: Mapping[str, Any] | None) -> None:
        super().__init__(call, tool_parameters, "name")  # name | pairs | value_open | value

    def _step(self, text: str, pos: int) -> int:
        rest = text[pos:]
        if self._state == "name":
            ends = [i for i in (rest.find("\n"), rest.find(KEY_OPEN), rest.find(CALL_CLOSE)) if i != -1]
            if not ends:
                return pos  # the name goes on in the next delta
            name = rest[:min(ends)].strip()
            if not name:
                if min(ends) == rest.find("\n"):
                    return pos + min(ends) + 1  # a newline before the name
                raise JsonSyntaxError("<tool_call> without a tool name")
            self.call.name = name
            self._state = "pairs"
            return pos + min(ends)
        body = rest.lstrip()
        skipped = len(rest) - len(body)
        if self._state == "pairs":
            if body.startswith(CALL_CLOSE):
                self._close()
                return pos + skipped + len(CALL_CLOSE)
            if body.startswith(KEY_OPEN):
                end = body.find(KEY_CLOSE)
                if end == -1:
                    return pos + skipped
                self._key = body[len(KEY_OPEN):end].strip()
                if not self._key:
                    raise JsonSyntaxError("<arg_key></arg_key> without a name")
                self._state = "value_open"
                return pos + skipped + end + len(KEY_CLOSE)
            if body and not (CALL_CLOSE.startswith(body) or KEY_OPEN.startswith(body)):
                raise JsonSyntaxError(f"unexpected {body[:20]!r} between GLM arguments")
            return pos + skipped
        if self._state == "value_open":
            if body.startswith(VALUE_OPEN):
                self._state = "value"
                return pos + skipped + len(VALUE_OPEN)
            if body and not VALUE_OPEN.startswith(body):
                raise JsonSyntaxError(f"<arg_key>{self._key}</arg_key> is not followed by <arg_value>")
            return pos + skipped
        end = rest.find(VALUE_CLOSE)
        if end == -1:
            return pos
        self._add_param(self._key, typed_value(rest[:end], self._schema(self._key)))
        self._state = "pairs"
        return pos + end + len(VALUE_CLOSE)


class GlmParser(OutputParser):
    tool_format = "glm"
    end_tokens = END_TOKENS
    think_tags = ("<think>", "</think>")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._state = "text"  # text | call | skip
        self._call: PendingCall | None = None
        self._reader: ArgKeyCall | None = None

    def _start_call(self) -> None:
        self._call = PendingCall(raw=CALL_OPEN)
        self._reader = ArgKeyCall(self._call, self.tool_parameters)
        self._state = "call"

    def _close_call(self, *, ok: bool) -> None:
        call, self._call, self._reader = self._call, None, None
        if ok:
            self._end_call(call)
        else:
            self._fail_call(call)
        self._state = "text"

    def _body_step(self, final: bool) -> bool:
        if self._state == "text":
            progressed, marker = self._text_step((CALL_OPEN,), final)
            if marker == CALL_OPEN:
                self._start_call()
            return progressed
        call = self._call
        if self._state == "call":
            end = self._read_call(call, self._reader.feed)
            if end is None:
                self._state = "skip"  # malformed: the block up to </tool_call> goes out as text
                return True
            if self._reader.done:
                self._close_call(ok=True)
                self._strip_text = True
            return end > 0
        junk, marker = self._take_until((CALL_CLOSE, *self.end_tokens), final)
        call.raw += junk + (marker if marker == CALL_CLOSE else "")
        if marker is None:
            return bool(junk)
        self._close_call(ok=False)
        return True

    def _finish_body(self) -> None:
        if self._call is not None:
            self._call.raw += self._buf
            self._close_call(ok=False)
