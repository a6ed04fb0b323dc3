"""DeepSeek-V3 tool calls (its special tokens, V3 and V3.1 forms) and `<think>` reasoning (R1, V3.1).

Grammar handled (DeepSeek's chat templates; fullwidth bars ｜ and ▁ are part of the tokens):

    [<think> reasoning </think>]  text
    <｜tool▁calls▁begin｜> (ws CALL)+ ws <｜tool▁calls▁end｜>  [text]
    CALL (V3, R1):  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
    CALL (V3.1):    <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>

* The two forms are told apart after ``<｜tool▁sep｜>``: a ``{`` starts V3.1 arguments (the name
  came before the separator); anything else is V3's name line, then an optional ```json fence.
* A call outside a ``<｜tool▁calls▁begin｜>`` section is accepted too; missing end tokens after a
  complete arguments object are tolerated.
* R1-style checkpoints open ``<think>`` in the prompt: use ``starts_in_reasoning``.
* ``<｜end▁of▁sentence｜>`` is the end-of-turn token and never text.
"""

from __future__ import annotations

from moed.text.output_parsers.base import OutputParser, PendingCall

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
EOS = "<｜end▁of▁sentence｜>"
FENCE = "```json"


class DeepSeekParser(OutputParser):
    tool_format = "deepseek"
    end_tokens = (EOS,)
    think_tags = ("<think>", "</think>")

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._state = "text"  # text | calls | head | after_sep | name | fence | args | tail | skip
        self._in_section = False
        self._call: PendingCall | None = None
        self._head = ""

    def _start_call(self) -> None:
        self._call = PendingCall(raw=CALL_BEGIN)
        self._head = ""
        self._state = "head"

    def _close_call(self, marker: str | None) -> None:
        """The call ended at marker (None: end of output); go where that marker leads."""
        call, self._call = self._call, None
        if self._state == "skip" or marker == CALL_END and not call.args.done:
            self._fail_call(call)
        else:
            self._end_call(call)
        if marker == CALL_BEGIN:
            self._start_call()
        elif marker == CALL_END and self._in_section:
            self._state = "calls"
        else:
            self._state = "text"
            self._in_section = False
            self._strip_text = marker == CALLS_END

    def _enter(self, marker: str | None) -> None:
        """Go where a marker found in text or between the calls of a section leads."""
        if marker == CALLS_BEGIN:
            self._state, self._in_section = "calls", True
        elif marker == CALL_BEGIN:
            self._start_call()
        elif marker == CALLS_END:
            self._state, self._in_section = "text", False
            self._strip_text = True

    def _body_step(self, final: bool) -> bool:
        state = self._state
        if state == "text":
            progressed, marker = self._text_step((CALLS_BEGIN, CALL_BEGIN), final)
            self._enter(marker)
            return progressed
        if state == "calls":  # between the calls of a section: whitespace is dropped
            text, marker = self._take_until((CALL_BEGIN, CALLS_END, EOS), final)
            if text.strip():
                self._emit_text(text)
            self._enter(marker)
            return marker is not None or bool(text)
        call = self._call
        if state == "head":
            head, marker = self._take_until((SEP, CALL_END), final)
            self._head += head
            call.raw += head + (marker or "")
            if marker == SEP:
                self._state = "after_sep"
            elif marker == CALL_END:
                self._state = "skip"
                self._close_call(marker)
            return marker is not None or bool(head)
        if state in ("after_sep", "fence"):
            body = self._take_space(call)
            if not body:
                return False
            if body[0] == "{":
                if state == "after_sep":
                    call.name = self._head.strip()  # V3.1: the name came before the separator
                self._state = "args"
            elif state == "after_sep":
                self._state = "name"  # V3: "function<sep>NAME\n```json\n{...}"
            elif body.startswith(FENCE) or (body.startswith("```") and (len(body) >= len(FENCE) or final)):
                n = len(FENCE) if body.startswith(FENCE) else 3
                call.raw += body[:n]
                self._buf = body[n:]
            elif FENCE.startswith(body) and not final:
                return False  # "`", "``", "```j": wait
            else:
                self._state = "skip"
            return True
        if state == "name":
            ends = [i for i in (self._buf.find("\n"), self._buf.find("`"), self._buf.find("{")) if i != -1]
            if not ends:
                if final:
                    self._state = "skip"
                    return True
                return False
            cut = min(ends)
            call.raw += self._buf[:cut]
            call.name = self._buf[:cut].strip() or None
            self._buf = self._buf[cut:]
            self._state = "fence" if call.name else "skip"
            return True
        if state == "args":
            end = self._read_call(call, call.add_args)
            if end is None:
                self._state = "skip"
                return True
            if call.args.done:
                self._state = "tail"
            return end > 0
        # tail (junk such as the closing fence, before CALL_END) and skip (malformed)
        markers = (CALL_END, CALL_BEGIN, CALLS_END, EOS) if state == "tail" else (CALL_END, CALLS_END, EOS)
        junk, marker = self._take_until(markers, final)
        call.raw += junk + (marker if marker == CALL_END else "")
        if marker is None:
            return bool(junk)
        self._close_call(marker)
        return True

    def _finish_body(self) -> None:
        if self._call is not None:
            self._call.raw += self._buf
            self._close_call(None)
