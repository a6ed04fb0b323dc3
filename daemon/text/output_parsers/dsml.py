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
from dataclasses import dataclass
from typing import Any

from moed.text.output_parsers.base import OutputParser, PendingCall
from moed.text.output_parsers.glm import typed_value
from moed.text.output_parsers.json_stream import JsonSyntaxError
from moed.text.output_parsers.xml_call import ParamCall

DSML = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"
_PARAM_HEAD = re.compile(r'([^"]*)"(?:\s+string="(true|false)")?\s*>')


@dataclass(frozen=True)
class InvokeMarkup:
    """The tags of a syntax of XML-like invokes (DeepSeek's DSML, MiniMax-M2's)."""

    section_opens: tuple[str, ...]
    section_closes: tuple[str, ...]
    tag_prefix: str  # "｜DSML｜" or ""

    @property
    def invoke_open(self) -> str:
        return f'<{self.tag_prefix}invoke name="'

    @property
    def invoke_close(self) -> str:
        return f"</{self.tag_prefix}invoke>"

    @property
    def param_open(self) -> str:
        return f'<{self.tag_prefix}parameter name="'

    @property
    def param_close(self) -> str:
        return f"</{self.tag_prefix}parameter>"


DSML_MARKUP = InvokeMarkup((f"<{DSML}function_calls>", f"<{DSML}tool_calls>"),
                           (f"</{DSML}function_calls>", f"</{DSML}tool_calls>"), DSML)


class DsmlInvoke(ParamCall):
    """Reads one invoke after ``<｜DSML｜invoke name="`` (``markup.invoke_open``) up to and including its closing
    tag. ``trim_newlines``: a raw value loses one newline at each end (MiniMax-M2 may write a value on lines of its
    own)."""

    def __init__(self, call: PendingCall, tool_parameters: Mapping[str, Any] | None,
                 markup: InvokeMarkup = DSML_MARKUP, trim_newlines: bool = False) -> None:
        super().__init__(call, tool_parameters, "name")  # name | params | value
        self._is_string: bool | None = None
        self.markup, self.trim_newlines = markup, trim_newlines

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
            m = self.markup
            if body.startswith(m.invoke_close):
                self._close()
                return pos + skipped + len(m.invoke_close)
            if body.startswith(m.param_open):
                head = _PARAM_HEAD.match(body, len(m.param_open))
                if head is None:
                    if ">" in body[len(m.param_open):]:
                        raise JsonSyntaxError("a DSML parameter tag must be name=\"KEY\" [string=\"true|false\"]")
                    return pos + skipped
                self._key = head.group(1).strip()
                if not self._key:
                    raise JsonSyntaxError("a DSML parameter without a name")
                self._is_string = None if head.group(2) is None else head.group(2) == "true"
                self._state = "value"
                return pos + skipped + head.end()
            if body and not (m.invoke_close.startswith(body) or m.param_open.startswith(body)):
                raise JsonSyntaxError(f"unexpected {body[:20]!r} between DSML parameters")
            return pos + skipped
        end = rest.find(self.markup.param_close)
        if end == -1:
            return pos
        raw = rest[:end]
        if self.trim_newlines:
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
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
        return pos + end + len(self.markup.param_close)


class DsmlParser(OutputParser):
    tool_format = "dsml"
    end_tokens = (EOS,)
    think_tags = ("<think>", "</think>")
    markup = DSML_MARKUP
    trim_newlines = False

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
            m = self.markup
            progressed, marker = self._text_step(m.section_opens, final)
            if marker in m.section_opens:
                self._state = "section"
            return progressed
        if state == "section":  # between the invokes of a section: whitespace is dropped
            m = self.markup
            text, marker = self._take_until((m.invoke_open, *m.section_closes, *self.end_tokens), final)
            if text.strip():
                self._emit_text(text)
            if marker == m.invoke_open:
                self._call = PendingCall(raw=m.invoke_open)
                self._reader = DsmlInvoke(self._call, self.tool_parameters, m, self.trim_newlines)
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
        m = self.markup
        junk, marker = self._take_until((m.invoke_close, *m.section_closes, *self.end_tokens), final)
        call.raw += junk + (marker if marker == m.invoke_close else "")
        if marker is None:
            return bool(junk)
        self._close_call(ok=False)
        self._state = "section" if marker == m.invoke_close else "text"
        return True

    def _finish_body(self) -> None:
        if self._call is not None:
            self._call.raw += self._buf
            self._close_call(ok=False)
