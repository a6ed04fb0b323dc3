"""Llama-4 (and Llama 3.x) tool calls: a JSON call object, or Llama-4's pythonic call list, opening the answer.

Grammar handled (Meta's Llama-4 chat template asks for the JSON form; Meta's Llama-4 prompt guide and vLLM's
``llama4_pythonic`` template for the pythonic one)::

    ws [<|python_start|>] ws CALL (ws ; ws CALL)* ws [<|python_end|>] [text]
        CALL = {"name": N, "parameters": {...}}            ("arguments" is read too)
    ws [ ws PYCALL (ws , ws PYCALL)* ws ] [text]
        PYCALL = name(key=LITERAL, ...)                     (Python literals: strings, numbers, True, None, [..], {..})

* A call opens the answer (after whitespace) or nothing is a call: text that starts otherwise is all text, and so
  is everything after the calls.
* JSON calls stream their arguments as they arrive. A pythonic list is held until it closes (or the output
  ends) and then parsed as Python (``ast``): its calls go out whole, their keyword arguments as a JSON object.
  While the held text can no longer become ``[name(``, it goes out as text at once.
* A malformed call, a pythonic list that is not one, or a call to a tool that was not offered: the block goes out
  as text, exactly as written.
* ``<|eot|>`` / ``<|eom|>`` (Llama-4) and ``<|eot_id|>`` / ``<|eom_id|>`` (Llama 3) end the turn and are never text.
"""

from __future__ import annotations

import ast
import json
import re

from moed.text.output_parsers.base import OutputParser, PendingCall
from moed.text.output_parsers.call_object import CallObject

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_PYCALL_OPENING = re.compile(r"\[\s*([A-Za-z_][\w.]*\s*(\()?)?")


class LlamaParser(OutputParser):
    tool_format = "llama4"
    end_tokens = ("<|eot|>", "<|eom|>", "<|eot_id|>", "<|eom_id|>")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._state = "start" if self.tools else "text"  # start | text | calls | object | skip | pythonic
        self._wrapped = False  # the calls sit in <|python_start|> ... <|python_end|>
        self._call: PendingCall | None = None
        self._object: CallObject | None = None

    def _body_step(self, final: bool) -> bool:
        state = self._state
        if state == "text":
            return self._text_step((), final)[0]
        if state == "start":
            return self._start(final)
        if state == "pythonic":
            return self._pythonic(final)
        if state == "calls":
            return self._between_calls(final)
        call = self._call
        if state == "object":
            end = self._read_call(call, self._object.feed)
            if end is None:
                self._state = "skip"
                return True
            if self._object.done:
                self._end_call(call)
                self._call, self._state = None, "calls"
            return end > 0
        # skip: a malformed call, up to the end of the turn
        junk, marker = self._take_until(self.end_tokens, final)
        call.raw += junk
        if marker is None and not final:
            return bool(junk)
        self._fail_call(call)
        self._call, self._state = None, "text"
        return True

    def _start(self, final: bool) -> bool:
        body = self._buf.lstrip()
        if not body and not final:
            return False
        if body.startswith(PYTHON_START):
            self._buf, self._wrapped, self._state = body[len(PYTHON_START):], True, "calls"
        elif body.startswith("{"):
            self._state = "calls"
        elif body.startswith("["):
            self._state = "pythonic"
        elif PYTHON_START.startswith(body) and body and not final:
            return False
        else:
            self._state = "text"
        return True

    def _between_calls(self, final: bool) -> bool:
        body = self._buf.lstrip().lstrip(";").lstrip()
        if not body:
            self._buf = ""
            if final:
                self._state = "text"
            return final
        if self._wrapped and body.startswith(PYTHON_END):
            self._buf, self._state, self._strip_text = body[len(PYTHON_END):], "text", True
            return True
        if self._wrapped and PYTHON_END.startswith(body) and not final:
            self._buf = body
            return False
        if body.startswith("{"):
            self._buf = body
            self._call = PendingCall()
            self._object = CallObject(self._call)
            self._state = "object"
            return True
        self._buf, self._state, self._strip_text = body, "text", True  # text after the calls
        return True

    def _pythonic(self, final: bool) -> bool:
        body = self._buf.lstrip()
        opening = _PYCALL_OPENING.match(body)
        could_be = opening is not None and (opening.group(2) is not None or opening.end() == len(body))
        if not could_be:
            self._state = "text"
            return True
        cut = len(body)
        for token in self.end_tokens:
            at = body.find(token)
            if at != -1:
                cut = min(cut, at)
        closed = _closing_bracket(body[:cut])
        if closed is None and cut == len(body) and not final:
            return False  # wait for the list to close
        end = cut if closed is None else closed
        block, self._buf = body[:end], body[end:]
        calls = _python_calls(block)
        if calls is None or (self.tool_names is not None and any(n not in self.tool_names for n, _ in calls)):
            self._emit_text(block)
        else:
            for name, arguments in calls:
                call = PendingCall(raw="", name=name)
                call.add_args(arguments)
                self._end_call(call)
            self._strip_text = True
        self._state = "text"
        return True

    def _finish_body(self) -> None:
        if self._call is not None:  # generation stopped inside a JSON call
            self._end_call(self._call)
            self._call = None


def _closing_bracket(text: str) -> int | None:
    """The index after the ``]`` that closes the list ``text`` opens (strings skipped), or None."""
    depth, quote, escaped = 0, "", False
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _python_calls(block: str) -> list[tuple[str, str]] | None:
    """``[f(a=1), g(b="x")]`` -> [("f", '{"a": 1}'), ("g", '{"b": "x"}')], or None when it is not such a list."""
    try:
        tree = ast.parse(block.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            text = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if len(arguments) != len(node.keywords):
            return None  # **kwargs
        calls.append((ast.unparse(node.func), text))
    return calls
