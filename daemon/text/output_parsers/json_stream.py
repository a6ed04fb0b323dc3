"""JsonStream: checks one JSON value arriving in pieces and knows where it ends (a pushdown automaton)."""

from __future__ import annotations

_WS = " \t\n\r"
_HEX = "0123456789abcdefABCDEF"
_DIGITS = "0123456789"
_ESCAPES = '"\\/bfnrtu'
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
# Number states in which the number may end (the next char is not part of it).
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})
_NUMBER_STATES = _NUMBER_ENDS | {"minus", "frac0", "exp0", "exp_sign"}


class JsonSyntaxError(ValueError):
    """The text so far is not the start of any JSON value."""


class JsonStream:
    """Feed the text of one JSON value in pieces; every char it accepts keeps the text a valid prefix.

    ``feed`` stops at the end of the value and returns how far it read, so the caller sees where
    the value ends (a number ends only when the next char arrives, or at ``is_complete_at_end``).
    Used to stream tool-call arguments: what it accepted is safe to send, and it says when the
    arguments object is complete. States are plain strings; ``depth`` counts open containers.
    """

    def __init__(self, *, require_object: bool = False) -> None:
        self.require_object = require_object
        self._stack: list[str] = []  # "{" or "["
        self._state = "value"
        self._string_is_key = False
        self._literal = ""  # the rest of true / false / null still to come
        self._hex_left = 0
        self.started = False  # the value's first char arrived
        self.done = False
        self.top_keys = 0  # keys completed in the outermost object (a sign the object is well on its way)

    @property
    def depth(self) -> int:
        return len(self._stack)

    @property
    def state(self) -> str:
        return self._state

    @property
    def in_key(self) -> bool:
        return self._state in ("string", "escape", "unicode") and self._string_is_key

    def is_complete_at_end(self) -> bool:
        """Whether the value is complete if no more text comes (a trailing top-level number counts)."""
        return self.done or (not self._stack and self._state in _NUMBER_ENDS)

    def feed(self, text: str, start: int = 0) -> int:
        """Accept text[start:] up to the end of the value; the index after the last accepted char."""
        i, n = start, len(text)
        while i < n and not self.done:
            if self.step(text[i]):
                i += 1
        return i

    def step(self, ch: str) -> bool:
        """Accept one char; False when ch is not part of the value (a number ended just before it)."""
        s = self._state
        if s == "string":
            if ch == '"':
                self._end_string()
            elif ch == "\\":
                self._state = "escape"
            elif ch < " ":
                raise JsonSyntaxError(f"control character {ch!r} inside a string")
            return True
        if s == "escape":
            if ch not in _ESCAPES:
                raise JsonSyntaxError(f"invalid escape \\{ch}")
            if ch == "u":
                self._state, self._hex_left = "unicode", 4
            else:
                self._state = "string"
            return True
        if s == "unicode":
            if ch not in _HEX:
                raise JsonSyntaxError(f"invalid \\u escape digit {ch!r}")
            self._hex_left -= 1
            if not self._hex_left:
                self._state = "string"
            return True
        if s in _NUMBER_STATES:
            return self._number(ch)
        if s == "literal":
            if ch != self._literal[0]:
                raise JsonSyntaxError(f"unexpected {ch!r} in a literal")
            self._literal = self._literal[1:]
            if not self._literal:
                self._close_value()
            return True
        if s == "done":
            return False
        if ch in _WS:
            return True
        if s == "value" or s == "value_or_end":
            if s == "value_or_end" and ch == "]":
                self._stack.pop()
                self._close_value()
                return True
            self._start_value(ch)
        elif s == "key_or_end" or s == "key":
            if s == "key_or_end" and ch == "}":
                self._stack.pop()
                self._close_value()
            elif ch == '"':
                self._state, self._string_is_key = "string", True
            else:
                raise JsonSyntaxError(f"expected a quoted key, got {ch!r}")
        elif s == "colon":
            if ch != ":":
                raise JsonSyntaxError(f"expected ':' after a key, got {ch!r}")
            self._state = "value"
        elif s == "after_value":
            top = self._stack[-1]
            if ch == ",":
                self._state = "key" if top == "{" else "value"
            elif ch == ("}" if top == "{" else "]"):
                self._stack.pop()
                self._close_value()
            else:
                raise JsonSyntaxError(f"expected ',' or {'}' if top == '{' else ']'!r}, got {ch!r}")
        return True

    def _start_value(self, ch: str) -> None:
        if not self.started and self.require_object and ch != "{":
            raise JsonSyntaxError(f"expected a JSON object, got {ch!r}")
        self.started = True
        if ch == "{":
            self._stack.append("{")
            self._state = "key_or_end"
        elif ch == "[":
            self._stack.append("[")
            self._state = "value_or_end"
        elif ch == '"':
            self._state, self._string_is_key = "string", False
        elif ch == "-":
            self._state = "minus"
        elif ch == "0":
            self._state = "zero"
        elif ch in _DIGITS:
            self._state = "int"
        elif ch in _LITERALS:
            self._state, self._literal = "literal", _LITERALS[ch]
        else:
            raise JsonSyntaxError(f"unexpected {ch!r} where a value should start")

    def _end_string(self) -> None:
        if self._string_is_key:
            self._state = "colon"
            if len(self._stack) == 1:
                self.top_keys += 1
        else:
            self._close_value()

    def _close_value(self) -> None:
        if self._stack:
            self._state = "after_value"
        else:
            self._state, self.done = "done", True

    def _number(self, ch: str) -> bool:
        s = self._state
        if ch in _DIGITS:
            if s == "minus":
                self._state = "zero" if ch == "0" else "int"
            elif s == "zero":
                raise JsonSyntaxError("a number may not have a leading zero")
            elif s in ("frac0", "frac"):
                self._state = "frac"
            elif s in ("exp0", "exp_sign", "exp"):
                self._state = "exp"
            return True
        if ch == "." and s in ("zero", "int"):
            self._state = "frac0"
            return True
        if ch in "eE" and s in ("zero", "int", "frac"):
            self._state = "exp0"
            return True
        if ch in "+-" and s == "exp0":
            self._state = "exp_sign"
            return True
        if s not in _NUMBER_ENDS:
            raise JsonSyntaxError(f"unexpected {ch!r} inside a number")
        self._close_value()
        return False
