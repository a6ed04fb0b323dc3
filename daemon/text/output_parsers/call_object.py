"""CallObject: reads `{"name": ..., "arguments": {...}}` in pieces into a PendingCall (Hermes, Mistral)."""

from __future__ import annotations

import json

from moed.text.output_parsers.base import PendingCall
from moed.text.output_parsers.json_stream import JsonStream, JsonSyntaxError

NAME_KEYS = frozenset({"name"})
ARGUMENT_KEYS = frozenset({"arguments", "parameters"})
_WS = " \t\n\r"


class CallObject:
    """The call object's syntax is checked as a whole; its top-level values are routed as they arrive.

    The name goes to ``call.name`` when its string closes; the arguments object streams into
    ``call.add_args`` char by char. Arguments given as a JSON string holding an object (some
    fine-tunes do this) are decoded when the string closes. Other keys (e.g. "id") are checked
    and ignored. Raises JsonSyntaxError for anything that is not such an object.
    """

    def __init__(self, call: PendingCall) -> None:
        self.call = call
        self._json = JsonStream(require_object=True)
        self._key_raw = ""
        self._key = ""
        self._capturing = False
        self._value_raw = ""  # the name's string, or arguments given as a string
        self._is_string_args = False

    @property
    def done(self) -> bool:
        return self._json.done

    def feed(self, text: str, start: int = 0) -> int:
        """Read text[start:] up to the end of the object; the index after the last char read."""
        j, i, n = self._json, start, len(text)
        while i < n and not j.done:
            ch = text[i]
            if self._capturing:
                consumed = j.step(ch)
                if consumed:
                    self._capture(ch)
                if j.depth == 1 and j.state == "after_value":
                    self._end_value()
                i += consumed
                continue
            if j.depth == 1 and j.state == "value" and ch not in _WS:
                self._start_value(ch)
                continue
            was_key = j.in_key
            j.step(ch)  # outside values every char is consumed (numbers only occur inside values)
            if was_key:
                if j.state == "colon":
                    self._key = json.loads('"' + self._key_raw + '"')
                else:
                    self._key_raw += ch
            elif j.in_key:
                self._key_raw = ""
            i += 1
        if j.done:
            self._end_object()
        return i

    def _start_value(self, ch: str) -> None:
        self._capturing = True
        self._value_raw = ""
        if self._key in ARGUMENT_KEYS:
            if self.call.args.started:
                raise JsonSyntaxError("the call has two arguments keys")
            self._is_string_args = ch == '"'

    def _capture(self, ch: str) -> None:
        if self._key in NAME_KEYS or (self._key in ARGUMENT_KEYS and self._is_string_args):
            self._value_raw += ch
        elif self._key in ARGUMENT_KEYS:
            self.call.add_args(ch)

    def _end_value(self) -> None:
        self._capturing = False
        if self._key in NAME_KEYS:
            name = json.loads(self._value_raw)
            if not isinstance(name, str) or not name:
                raise JsonSyntaxError(f"the call's name must be a non-empty string, got {self._value_raw}")
            self.call.name = name
        elif self._key in ARGUMENT_KEYS and self._is_string_args:
            inner = json.loads(self._value_raw).strip()
            end = self.call.add_args(inner)
            if not self.call.args.done or inner[end:].strip():
                raise JsonSyntaxError("arguments given as a string must hold one JSON object")
        elif self._key in ARGUMENT_KEYS and not self.call.args.done:
            raise JsonSyntaxError("the arguments must be a JSON object")

    def _end_object(self) -> None:
        if self.call.name is None:
            raise JsonSyntaxError('the call object has no "name"')
        if not self.call.args.started:
            self.call.add_args("{}")
