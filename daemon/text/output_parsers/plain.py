"""The plain parser for families without a tool-call or reasoning syntax (OLMoE, ...): all output is text."""

from __future__ import annotations

from moed.text.output_parsers.base import OutputParser


class PlainParser(OutputParser):
    """Every delta goes out as text at once; nothing is held back and no special token is dropped."""

    def _body_step(self, final: bool) -> bool:
        self._emit_text(self._buf)
        progressed, self._buf = bool(self._buf), ""
        return progressed

    def _finish_body(self) -> None:
        pass
