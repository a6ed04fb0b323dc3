"""Hermes-style tool calls (Qwen2-MoE, Qwen3-MoE): `<tool_call>{"name", "arguments"}</tool_call>`, `<think>`.

Grammar handled (Qwen's chat templates ask for exactly this):

    [<think> reasoning </think>]  text  (<tool_call> ws {"name": N, "arguments": {...}} ws </tool_call> ws)*  [text]

Qwen3-Coder writes the block's body as XML instead (``<function=N><parameter=K>v</parameter></function>``,
see ``xml_call``); a body starting with ``<function=`` is read that way.

* ``<think>`` counts only at the very start of the output (Qwen3 opens it there); with
  ``starts_in_reasoning`` the output begins inside reasoning (the prompt ended with ``<think>``)
  and only ``</think>`` is expected. Qwen2-MoE has no reasoning tags.
* Several calls may follow each other; whitespace after a call is dropped. A missing
  ``</tool_call>`` after a complete object is tolerated (the next ``<tool_call>`` or the end closes it).
* ``"parameters"`` is accepted for ``"arguments"``, and arguments given as a JSON string are decoded.
* ``<|im_end|>`` / ``<|endoftext|>`` are end-of-turn tokens and never text.
"""

from __future__ import annotations

from moed.text.output_parsers.base import OutputParser, PendingCall
from moed.text.output_parsers.call_object import CallObject
from moed.text.output_parsers.xml_call import FUNCTION_OPEN, XmlCall

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


class HermesParser(OutputParser):
    tool_format = "hermes"
    end_tokens = ("<|im_end|>", "<|endoftext|>")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._state = "text"  # text | open | object | tail | skip
        self._call: PendingCall | None = None
        self._object: CallObject | XmlCall | None = None

    def _start_call(self) -> None:
        self._call = PendingCall(raw=CALL_OPEN)
        self._object = CallObject(self._call)
        self._state = "open"

    def _close_call(self, *, ok: bool) -> None:
        call, self._call, self._object = self._call, None, None
        if ok:
            self._end_call(call)
        else:
            self._fail_call(call)
        self._state = "text"

    def _body_step(self, final: bool) -> bool:
        state = self._state
        if state == "text":
            progressed, marker = self._text_step((CALL_OPEN,), final)
            if marker == CALL_OPEN:
                self._start_call()
            return progressed
        call = self._call
        if state == "open":
            body = self._take_space(call)
            if not body:
                return False
            if body[0] == "{":
                self._state = "object"
            elif body.startswith(FUNCTION_OPEN):
                self._object = XmlCall(call, self.tool_parameters)  # Qwen3-Coder
                self._state = "object"
            elif FUNCTION_OPEN.startswith(body) and not final:
                return False
            else:
                self._state = "skip"
            return True
        if state == "object":
            end = self._read_call(call, self._object.feed)
            if end is None:
                self._state = "skip"  # the skip state takes the whole buffer into call.raw
                return True
            if self._object.done:
                self._state = "tail"
            return end > 0
        # tail (after a complete object) and skip (malformed) both wait for the closing marker
        markers = (CALL_CLOSE, CALL_OPEN, *self.end_tokens) if state == "tail" else (CALL_CLOSE, *self.end_tokens)
        junk, marker = self._take_until(markers, final)
        call.raw += junk + (marker if marker == CALL_CLOSE else "")
        if marker is None:
            return bool(junk)
        self._close_call(ok=state == "tail")
        if marker == CALL_OPEN:
            self._start_call()
        elif state == "tail":
            self._strip_text = True
        return True

    def _finish_body(self) -> None:
        if self._call is not None:
            self._call.raw += self._buf
            self._close_call(ok=self._state != "skip")


class Qwen3Parser(HermesParser):
    tool_format = "qwen3"
    think_tags = ("<think>", "</think>")
