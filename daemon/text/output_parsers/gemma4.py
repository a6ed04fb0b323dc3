"""Gemma-4 tool calls and reasoning.

Grammar handled (Google's Gemma-4 prompt-formatting guide; transformers' Gemma-4 response parser)::

    [<|channel>thought reasoning <channel|>]  text  (<|tool_call>call:NAME{ARGS}<tool_call|>)*  [text]
        ARGS: JSON with unquoted keys and strings delimited by <|"|> (numbers, booleans, arrays, objects bare)

* ``{location:<|"|>London<|"|>,days:3}`` is read as ``{"location": "London", "days": 3}``; quoted keys and
  ordinary JSON strings are read too.
* A call goes out whole when ``<tool_call|>`` closes it (its arguments are not streamed piece by piece: the
  relaxed syntax is checked as a whole). A malformed call, or one to a tool that was not offered, goes out as text
  exactly as written.
* ``<turn|>``, ``<|tool_response>`` (written after the calls) and ``<eos>`` end the turn and are never text.
"""

from __future__ import annotations

import json
import re

from moed.text.output_parsers.base import OutputParser, PendingCall

CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
_CALL = re.compile(r"\s*call:([A-Za-z_][\w.\-]*)\s*(\{.*\})\s*", re.DOTALL)
_KEY = re.compile(r"[A-Za-z_][\w\-]*")


class Gemma4Parser(OutputParser):
    tool_format = "gemma4"
    end_tokens = ("<turn|>", "<|tool_response>", "<eos>")
    think_tags = ("<|channel>thought", "<channel|>")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._call: PendingCall | None = None

    def _body_step(self, final: bool) -> bool:
        if self._call is None:
            progressed, marker = self._text_step((CALL_OPEN,), final)
            if marker == CALL_OPEN:
                self._call = PendingCall(raw=marker)
            return progressed
        body, marker = self._take_until((CALL_CLOSE, *self.end_tokens), final)
        call = self._call
        call.raw += body
        if marker is None and not final:
            return bool(body)
        self._call = None
        if marker == CALL_CLOSE:
            call.raw += marker
            parsed = _parse_call(call.raw[len(CALL_OPEN):-len(CALL_CLOSE)])
            if parsed is not None:
                call.name = parsed[0]
                call.add_args(parsed[1])
                self._end_call(call)
                self._strip_text = True
                return True
        self._fail_call(call)
        return True

    def _finish_body(self) -> None:
        if self._call is not None:  # generation stopped inside a call
            self._fail_call(self._call)
            self._call = None


def _parse_call(text: str) -> tuple[str, str] | None:
    """``call:NAME{ARGS}`` -> (NAME, ARGS as JSON object text), or None."""
    match = _CALL.fullmatch(text)
    if match is None:
        return None
    args = relaxed_json(match.group(2))
    if args is None:
        return None
    try:
        value = json.loads(args)
    except ValueError:
        return None
    return (match.group(1), json.dumps(value, ensure_ascii=False)) if isinstance(value, dict) else None


def relaxed_json(text: str) -> str | None:
    """Gemma-4's argument syntax as JSON text: ``<|"|>..<|"|>`` strings, unquoted keys (None when a string does not
    close)."""
    out, i, n = [], 0, len(text)
    stack: list[str] = []
    expect_key = False
    while i < n:
        if text.startswith(QUOTE, i):
            end = text.find(QUOTE, i + len(QUOTE))
            if end < 0:
                return None
            out.append(json.dumps(text[i + len(QUOTE):end], ensure_ascii=False))
            i, expect_key = end + len(QUOTE), False
            continue
        ch = text[i]
        if ch == '"':  # an ordinary JSON string, copied through
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                return None
            out.append(text[i:j + 1])
            i, expect_key = j + 1, False
            continue
        if expect_key and (key := _KEY.match(text, i)) is not None:
            out.append(json.dumps(key.group(0)))
            i, expect_key = key.end(), False
            continue
        if ch in "{[":
            stack.append(ch)
            expect_key = ch == "{"
        elif ch in "}]":
            if stack:
                stack.pop()
            expect_key = False
        elif ch == ",":
            expect_key = bool(stack) and stack[-1] == "{"
        elif not ch.isspace():
            expect_key = False
        out.append(ch)
        i += 1
    return "".join(out)
