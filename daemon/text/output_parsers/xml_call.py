"""XmlCall: Qwen3-Coder's XML tool-call body, `<function=NAME><parameter=KEY>value</parameter>...</function>`.

Qwen3-Coder (a qwen3_moe checkpoint) writes its calls inside the same ``<tool_call>`` block as
Hermes, but as XML with raw parameter values. Each value is turned into JSON when its parameter
closes, by the type the tool's schema gives it (``tool_parameters``: tool name -> JSON schema):
strings stay strings, integer/number/boolean/object/array values are parsed (and stay strings
when they do not parse), "null" is null; without a schema every value is a string. The
arguments then stream one ``"key": value`` piece per parameter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from moed.text.output_parsers.base import PendingCall
from moed.text.output_parsers.json_stream import JsonSyntaxError

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
_VALUE_ENDS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE)


def _schema_type(schema: Any) -> str:
    kind = schema.get("type", "string") if isinstance(schema, Mapping) else "string"
    if isinstance(kind, list):  # e.g. ["integer", "null"]
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).lower()


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's raw text as the JSON value its schema type asks for (the text itself if it does not parse)."""
    if raw.strip().lower() == "null":
        return None
    kind = _schema_type(schema)
    text = raw.strip()
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(number) if number.is_integer() and not any(c in text for c in ".eE") else number
        if kind == "boolean":
            return {"true": True, "false": False}[text.lower()]
        if kind in ("object", "array"):
            value = json.loads(text)
            return value if isinstance(value, dict if kind == "object" else list) else raw
    except (ValueError, KeyError):
        return raw
    return raw


class ParamCall:
    """A call written as named parameters with raw values (Qwen3-Coder's XML, GLM's arg pairs, DeepSeek's DSML):
    a reader of its block in pieces. ``feed`` returns how far it could read; subclasses read one piece per
    ``_step`` and hand each parameter to ``_add_param``, which appends its ``"key": value`` to the arguments."""

    def __init__(self, call: PendingCall, tool_parameters: Mapping[str, Any] | None, state: str) -> None:
        self.call = call
        self._tool_parameters = tool_parameters or {}
        self._state = state
        self._key = ""
        self._num_params = 0
        self.done = False

    def feed(self, text: str) -> int:
        pos = 0
        while pos < len(text) and not self.done:
            step = self._step(text, pos)
            if step == pos:
                break
            pos = step
        return pos

    def _step(self, text: str, pos: int) -> int:
        raise NotImplementedError

    def _schema(self, key: str) -> Any:
        """The JSON schema of parameter ``key`` of the called tool (None when the request gave none)."""
        schema = self._tool_parameters.get(self.call.name, {})
        properties = schema.get("properties", {}) if isinstance(schema, Mapping) else {}
        return properties.get(key) if isinstance(properties, Mapping) else None

    def _add_param(self, key: str, value: Any) -> None:
        piece = ("{" if not self._num_params else ", ") + json.dumps(key, ensure_ascii=False) + ": " \
            + json.dumps(value, ensure_ascii=False)
        self.call.add_args(piece)
        self._num_params += 1

    def _close(self) -> None:
        """The call's end: its arguments object closed."""
        self.call.add_args("}" if self._num_params else "{}")
        self.done = True


class XmlCall(ParamCall):
    """Reads the block after ``<tool_call>`` in pieces; ``feed`` returns how far it could read."""

    def __init__(self, call: PendingCall, tool_parameters: Mapping[str, Any] | None) -> None:
        super().__init__(call, tool_parameters, "function")  # function | body | value

    def _step(self, text: str, pos: int) -> int:
        rest = text[pos:]
        if self._state == "function":
            if not rest.startswith(FUNCTION_OPEN):
                if not FUNCTION_OPEN.startswith(rest):
                    raise JsonSyntaxError("a tool call block must start with <function=NAME>")
                return pos
            end = rest.find(">")
            if end == -1:
                return pos
            name = rest[len(FUNCTION_OPEN):end].strip()
            if not name:
                raise JsonSyntaxError("<function=> without a name")
            self.call.name = name
            self._state = "body"
            return pos + end + 1
        if self._state == "body":
            body = rest.lstrip()
            skipped = len(rest) - len(body)
            if body.startswith(FUNCTION_CLOSE):
                self._close()
                return pos + skipped + len(FUNCTION_CLOSE)
            if body.startswith(PARAMETER_OPEN):
                end = body.find(">")
                if end == -1:
                    return pos + skipped
                self._key = body[len(PARAMETER_OPEN):end].strip()
                if not self._key:
                    raise JsonSyntaxError("<parameter=> without a name")
                self._state = "value"
                return pos + skipped + end + 1
            if body and not (FUNCTION_CLOSE.startswith(body) or PARAMETER_OPEN.startswith(body)):
                raise JsonSyntaxError(f"unexpected {body[:20]!r} between parameters")
            return pos + skipped
        # value: up to the first of </parameter>, the next <parameter= or </function>
        ends = [(i, m) for m in _VALUE_ENDS if (i := rest.find(m)) != -1]
        if not ends:
            return pos
        end, marker = min(ends)
        raw = rest[:end]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        self._add_param(self._key, convert_value(raw, self._schema(self._key)))
        self._state = "body"
        return pos + end + (len(marker) if marker == PARAMETER_CLOSE else 0)
