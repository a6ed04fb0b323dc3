"""Incremental detokenizer: growing token ids in, UTF-8-safe text deltas out (text-generation-inference's scheme)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

# A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives.
REPLACEMENT_CHAR = "\ufffd"
# Tokens of the prompt tail kept as left context: enough for decoders that drop or add a leading space.
CONTEXT_TOKENS = 5

DecodeFn = Callable[..., str]


class StreamDecoder:
    """Turns generated token ids into text deltas whose concatenation equals decoding all of them at once.

    Decoding token by token is wrong for two reasons: byte-level BPE can split one character over
    several tokens (each alone is invalid UTF-8), and SentencePiece-style decoders strip or add
    spaces depending on what comes before. So each step decodes a short window (the tokens since
    the previous emission plus the new ones) and emits only the text past what the window's
    prefix already produced, holding everything back while that text still ends in U+FFFD.
    """

    def __init__(
        self,
        decode: DecodeFn,
        *,
        context_ids: Iterable[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode_fn = decode
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(context_ids)[-CONTEXT_TOKENS:]
        self._prefix_offset = 0  # window start: first token whose text we re-decode for context
        self._read_offset = len(self._ids)  # tokens before this have been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text that became final (often "", never broken UTF-8)."""
        self._ids.append(token_id)
        return self._advance()

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Append several ids at once (e.g. accepted speculative tokens) and return their final text."""
        self._ids.extend(token_ids)
        return self._advance()

    def _advance(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            # Drop tokens that can no longer affect future text so each step decodes O(1) tokens.
            del self._ids[: self._read_offset]
            self._prefix_offset, self._read_offset = 0, len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end of generation (may contain U+FFFD if the model stopped mid-character)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
