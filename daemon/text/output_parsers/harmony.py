"""gpt-oss output in OpenAI's harmony format: channels (analysis / commentary / final) and function calls.

Grammar handled (openai/harmony docs/format.md). The prompt ends with ``<|start|>assistant``, so
the first message's header has no ``<|start|>``:

    MESSAGE = [<|start|>ROLE] HEADER <|message|> CONTENT (<|end|> | <|call|> | <|return|> | end of output)
    HEADER  = [ to=RECIPIENT] <|channel|>CHANNEL [ to=RECIPIENT] [ [<|constrain|>]json]

Routing of a message's content:

* recipient ``functions.NAME`` (in the role part or after the channel, on the commentary or
  analysis channel): a tool call whose content is the JSON arguments;
* another recipient (the built-in ``browser.*`` / ``python`` tools, which moed does not run):
  reasoning, like the analysis channel;
* ``analysis``: reasoning; ``final``, ``commentary`` without a recipient (a preamble meant for the
  user) and anything else: text; a message whose role is not the assistant's is dropped.

``<|call|>`` and ``<|return|>`` are stop tokens, so the engine may leave them out: the end of
output closes the open message. A ``<|start|>`` or ``<|channel|>`` inside content also ends it
(the model skipped ``<|end|>``). Header text never reaches the output; output with no harmony
structure at all (a header running past 256 characters) is passed through as text.
"""

from __future__ import annotations

import re

from moed.text.output_parsers.base import OutputParser, PendingCall
from moed.text.output_parsers.json_stream import JsonSyntaxError

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CALL = "<|call|>"
RETURN = "<|return|>"
END_OF_TEXT = "<|endoftext|>"
MAX_HEADER_CHARS = 256

_CONTENT_ENDS = (END, CALL, RETURN, START, CHANNEL, END_OF_TEXT)
_HEADER_MARKERS = (MESSAGE, START, END, CALL, RETURN, END_OF_TEXT)
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"(?:^|\s)to=([^\s<]+)")


class HarmonyParser(OutputParser):
    tool_format = "harmony"
    end_tokens = (CALL, RETURN, END_OF_TEXT)

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._state = "header"  # header | content | plain
        self._header = ""
        self._route = ""  # text | reasoning | call | skip_call | drop
        self._call: PendingCall | None = None

    def _open_message(self, header: str) -> None:
        channel = _CHANNEL_RE.search(header)
        recipient = _RECIPIENT_RE.search(header)
        role = re.split(r"<\||\s", header.strip(), maxsplit=1)[0] if not header.lstrip().startswith("<|") else ""
        channel_name = channel.group(1) if channel else ""
        target = recipient.group(1) if recipient else ""
        if role and role != "assistant":
            self._route = "drop"  # e.g. the model writing a tool's reply itself
        elif target.startswith("functions.") and len(target) > len("functions."):
            if self.tools:
                self._route = "call"
                self._call = PendingCall(name=target[len("functions."):])
            else:
                self._route = "text"
        elif target or channel_name == "analysis":
            self._route = "reasoning"
        else:
            self._route = "text"
        self._state = "content"

    def _close_message(self) -> None:
        if self._route in ("call", "skip_call"):
            call, self._call = self._call, None
            if self._route == "call":
                self._end_call(call)
            else:
                self._fail_call(call)
        self._route = ""
        self._header = ""
        self._state = "header"

    def _body_step(self, final: bool) -> bool:
        if self._state == "plain":
            self._emit_text(self._buf)
            progressed, self._buf = bool(self._buf), ""
            return progressed
        if self._state == "header":
            header, marker = self._take_until(_HEADER_MARKERS, final)
            self._header += header
            if marker == MESSAGE:
                self._open_message(self._header)
            elif marker is not None:
                self._header = ""  # a new message starts, or an empty one ended
            elif len(self._header) > MAX_HEADER_CHARS and START not in self._header:
                self._state = "plain"  # not harmony at all
                self._emit_text(self._header)
                self._header = ""
            return marker is not None or bool(header)
        content, marker = self._take_until(_CONTENT_ENDS, final)
        self._route_content(content)
        if marker is None:
            return bool(content)
        self._close_message()
        if marker == CHANNEL:
            self._header = CHANNEL
        return True

    def _route_content(self, content: str) -> None:
        route = self._route
        if route == "text":
            self._emit_text(content)
        elif route == "reasoning":
            self._emit_reasoning(content)
        elif route in ("call", "skip_call"):
            call = self._call
            call.raw += content
            if route == "call" and not call.args.done:
                try:
                    call.add_args(content)
                except JsonSyntaxError:
                    self._route = "skip_call"
                    return
                self._flush_call(call)

    def _finish_body(self) -> None:
        if self._state == "content":
            self._close_message()
        elif self._header and "<|" not in self._header:
            self._emit_text(self._header)  # output that never used harmony's structure
