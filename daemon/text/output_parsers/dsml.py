"""DeepSeek-V3.2 / V4 tool calls in DSML (`<｜DSML｜invoke name="N"><｜DSML｜parameter ...>`) and `<think>`.

Grammar handled (DeepSeek's encoding scripts write exactly this; V3.2 names the section
``function_calls``, V4 ``tool_calls``; ｜ is the fullwidth bar, part of the tokens)::

    [<think> reasoning </think>]  text
    <｜DSML｜function_calls> ws (INVOKE ws)+ </｜DSML｜function_calls>  [text]
    INVOKE: <｜DSML｜invoke name="NAME"> ws
              (<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter> ws)*
            </｜DSML｜invoke>

* ``string="true"``: the value is the text as written; ``string="false"``: it is JSON (a number, boolean,
  array or object), read with the tool's schema type when the JSON does not parse. Without the attribute
  the schema decides (``glm.typed_value``).
* The arguments stream one ``"key": value`` piece per parameter; a call is complete at ``</｜DSML｜invoke>``.
* In thinking mode the prompt opens ``<think>`` (use ``starts_in_reasoning``).
* ``<｜end▁of▁sentence｜>`` ends the turn and is never text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from moed.text.output_parsers.base import OutputParser, PendingCall
from moed.text.output_parsers.glm import typed_value
from moed.text.output_parsers.json_stream import JsonSyntaxError
from moed.text.output_parsers.xml_call import ParamCall

DSML = "｜DSML｜"
SECTION_OPENS = (f"<{DSML}function_calls>", f"<{DSML}tool_calls>")
SECTION_CLOSES = (f"</{DSML}function_calls>", f"</{DSML}tool_calls>")
INVOKE_OPEN = f'<{DSML}invoke name="'
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f'<{DSML}parameter name="'
PARAM_CLOSE = f"</{DSML}parameter>"
EOS = "<｜end▁of▁sentence｜>"
_PARAM_HEAD = re.compile(r'([^"]*)"(?:\s+string="(true|false)")?\s*>')


class DsmlInvoke(ParamCall):
    """Reads one invoke after ``<｜DSML｜invoke name="`` up to and including ``</｜DSML｜invoke>``."""

    def __init__(self, call: PendingCall, tool_parameters: Mapping[str, Any] | None) -> None:
        super().__init__(call, tool_parameters, "name")  # name | params | value
        self._is_string: bool | None = None

    def _step(self, text: str, pos: int) -> int:
        rest = text[pos:]
        if self._state == "name":
            end = rest.find('">')
            if end == -1:
                if '"' in rest and not rest.endswith('"'):
                    raise JsonSyntaxError("a DSML invoke's name must end with '\">'")
                return pos
            name = rest[:end].strip()
            if not name:
                raise JsonSyntaxError("a DSML invoke without a name")
            self.call.name = name
            self._state = "params"
            return pos + end + 2
        if self._state == "params":
            body = rest.lstrip()
            skipped = len(rest) - len(body)
            if body.startswith(INVOKE_CLOSE):
                self._close()
                return pos + skipped + len(INVOKE_CLOSE)
            if body.startswith(PARAM_OPEN):
                head = _PARAM_HEAD.match(body, len(PARAM_OPEN))
                if head is None:
                    if ">" in body[len(PARAM_OPEN):]:
                        raise JsonSyntaxError("a DSML parameter tag must be name=\"KEY\" [string=\"true|false\"]")
                    return pos + skipped
                self._key = head.group(1).strip()
                if not self._key:
                    raise JsonSyntaxError("a DSML parameter without a name")
                self._is_string = None if head.group(2) is None else head.group(2) == "true"
                self._state = "value"
                return pos + skipped + head.end()
            if body and not (INVOKE_CLOSE.startswith(body) or PARAM_OPEN.startswith(body)):
                raise JsonSyntaxError(f"unexpected {body[:20]!r} between DSML parameters")
            return pos + skipped
        end = rest.find(PARAM_CLOSE)
        if end == -1:
            return pos
        raw = rest[:end]
        prop = self._schema(self._key)
        if self._is_string:
            value = raw
        elif self._is_string is False:
            try:
                value = json.loads(raw)
            except ValueError:
                value = typed_value(raw, prop)
        else:
            value = typed_value(raw, prop)
        self._add_param(self._key, value)
        self._state = "params"
        return pos + end + len(PARAM_CLOSE)


class DsmlParser(OutputParser):
    tool_format = "dsml"
    end_tokens = (EOS,)
    think_tags = ("<think>", "</think>")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._state = "text"  # text | section | call | skip
        self._call: PendingCall | None = None
        self._reader: DsmlInvoke | None = None

    def _close_call(self, *, ok: bool) -> None:
        call, self._call, self._reader = self._call, None, None
        if ok:
            self._end_call(call)
        else:
            self._fail_call(call)

    def _body_step(self, final: bool) -> bool:
        state = self._state
        if state == "text":
            progressed, marker = self._text_step(SECTION_OPENS, final)
            if marker in SECTION_OPENS:
                self._state = "section"
            return progressed
        if state == "section":  # between the invokes of a section: whitespace is dropped
            text, marker = self._take_until((INVOKE_OPEN, *SECTION_CLOSES, *self.end_tokens), final)
            if text.strip():
                self._emit_text(text)
            if marker == INVOKE_OPEN:
                self._call = PendingCall(raw=INVOKE_OPEN)
                self._reader = DsmlInvoke(self._call, self.tool_parameters)
                self._state = "call"
            elif marker is not None:
                self._state = "text"
                self._strip_text = True
            return marker is not None or bool(text)
        call = self._call
        if state == "call":
            end = self._read_call(call, self._reader.feed)
            if end is None:
                self._state = "skip"
                return True
            if self._reader.done:
                self._close_call(ok=True)
                self._state = "section"
            return end > 0
        # skip: a malformed invoke, up to its end
        junk, marker = self._take_until((INVOKE_CLOSE, *SECTION_CLOSES, *self.end_tokens), final)
        call.raw += junk + (marker if marker == INVOKE_CLOSE else "")
        if marker is None:
            return bool(junk)
        self._close_call(ok=False)
        self._state = "section" if marker == INVOKE_CLOSE else "text"
        return True

    def _finish_body(self) -> None:
        if self._call is not None:
            self._call.raw += self._buf
            self._close_call(ok=False)
