"""Kimi tool calls (Kimi-K2, Kimi-Linear: Moonshot's section tokens) and `<think>` reasoning (Kimi-K2-Thinking).

Grammar handled (Moonshot's chat templates and tool-call guide)::

    [<think> reasoning </think>]  text
    <|tool_calls_section_begin|> (ws CALL)+ ws <|tool_calls_section_end|>  [text]
    CALL: <|tool_call_begin|> functions.NAME:INDEX <|tool_call_argument_begin|> {...} <|tool_call_end|>

* The call's id is the model's own ``functions.NAME:INDEX`` (Moonshot's templates render a call's id back into the
  history, and the model expects its own form there); a name without the ``functions.`` prefix or the index is
  taken as it is.
* Arguments stream as they arrive. A malformed call goes out as text exactly as written.
* ``<|im_end|>`` ends the turn and is never text.
"""

from __future__ import annotations

from moed.text.output_parsers.base import OutputParser, PendingCall

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
EOS = "<|im_end|>"


def _name_of(call_id: str) -> str:
    """``functions.get_weather:0`` -> ``get_weather``."""
    name = call_id.strip()
    name = name[len("functions."):] if name.startswith("functions.") else name
    return name.rpartition(":")[0] if ":" in name else name


class KimiParser(OutputParser):
    tool_format = "kimi"
    end_tokens = (EOS,)
    think_tags = ("<think>", "</think>")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._state = "text"  # text | calls | head | args | tail
        self._call: PendingCall | None = None
        self._head = ""
        self._call_id = ""
        self._in_section = False

    def _new_tool_id(self) -> str:
        return self._call_id or super()._new_tool_id()

    def _body_step(self, final: bool) -> bool:
        state = self._state
        if state == "text":
            progressed, marker = self._text_step((SECTION_BEGIN, CALL_BEGIN), final)
            if marker == SECTION_BEGIN:
                self._state, self._in_section = "calls", True
            elif marker == CALL_BEGIN:
                self._begin()
            return progressed
        if state == "calls":  # between the calls of a section: whitespace is dropped
            text, marker = self._take_until((CALL_BEGIN, SECTION_END, EOS), final)
            if text.strip():
                self._emit_text(text)
            if marker == CALL_BEGIN:
                self._begin()
            elif marker is not None:
                self._state, self._strip_text, self._in_section = "text", True, False
            return marker is not None or bool(text)
        call = self._call
        if state == "head":
            head, marker = self._take_until((ARGS_BEGIN, CALL_END, SECTION_END), final)
            self._head += head
            call.raw += head + (marker or "")
            if marker == ARGS_BEGIN:
                self._call_id = self._head.strip()
                call.name = _name_of(self._head) or None
                self._state = "args" if call.name else "tail"
            elif marker is not None or final:
                self._close(marker, failed=True)
            return marker is not None or bool(head)
        if state == "args":
            if not call.args_text:
                self._take_space(call)  # before the arguments only: inside them spaces are the model's
            end = self._read_call(call, call.add_args)
            if end is None:  # not a JSON object: the block up to its end goes out as text
                self._state = "tail"
                return True
            if call.args.done:
                self._state = "tail"
            return end > 0
        # tail: what comes after the arguments, up to the call's end
        junk, marker = self._take_until((CALL_END, SECTION_END, EOS), final)
        call.raw += junk + (marker if marker == CALL_END else "")
        if marker is None and not final:
            return bool(junk)
        self._close(marker, failed=bool(junk.strip()) or not call.args.done)
        return True

    def _begin(self) -> None:
        self._call, self._head, self._call_id, self._state = PendingCall(raw=CALL_BEGIN), "", "", "head"

    def _close(self, marker: str | None, *, failed: bool) -> None:
        call, self._call = self._call, None
        if failed:
            self._fail_call(call)
        else:
            self._end_call(call)
        self._call_id = ""
        self._state = "calls" if marker == CALL_END and self._in_section else "text"
        self._strip_text = marker == SECTION_END
        self._in_section = self._state == "calls"

    def _finish_body(self) -> None:
        if self._call is not None:
            self._call.raw += self._buf
            self._close(None, failed=not self._call.args.done)
