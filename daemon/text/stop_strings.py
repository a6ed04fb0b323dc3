"""Stop-string matching over streamed text, holding back only what could still become a stop string."""

from __future__ import annotations

from collections.abc import Sequence

from moed.errors import InvalidRequestError, quoted


class StopMatcher:
    """Feed text deltas; get back text that is safe to emit and whether a stop string was hit.

    Text that ends in a prefix of some stop string is held back until the next delta decides it,
    so a stop string split across deltas is still caught and never partially emitted.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            raise InvalidRequestError("stop must be a list of strings, not a single string; wrap it in a list.")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {quoted(s)}.")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._pending = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, delta: str) -> tuple[str, bool]:
        """Return (text to emit now, stop hit). After a hit the rest of the stream is dropped."""
        if self._stopped:
            return "", True
        if not self._stops:
            return delta, False
        buf = self._pending + delta
        # The stop that completes first wins (ties: the one starting first), as if text came one char at a
        # time, so the result never depends on how the text was split into deltas.
        hits = [(i + len(s), i) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self._pending = ""
            self._stopped = True
            return buf[: min(hits)[1]], True
        keep = self._held_suffix_len(buf)
        self._pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _held_suffix_len(self, buf: str) -> int:
        # Longest tail of buf that is a proper prefix of a stop string (a full match was ruled out above).
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def flush(self) -> str:
        """Held-back text at the end of the stream (it never completed a stop string)."""
        out, self._pending = ("" if self._stopped else self._pending), ""
        return out
