"""Constrained decoding: what a request's output must match, and each sequence's matcher of it (issue #34).

A ``Grammar`` is plain data on the request (``SamplingParams.grammar``): a JSON schema, a Lark or GBNF
grammar, or a regular expression. The llguidance library (Microsoft's, also used by llama.cpp and vLLM)
compiles it against the model's tokenizer and, per sequence, says which tokens may come next; moed does
not parse grammars itself (docs/design.md, "Constrained decoding", has the choice and its measurements).

``GrammarTokenizer`` wraps one model's tokenizer for llguidance (built once, on the first constrained
request: 0.2-0.9 s for a 49k-150k vocabulary). ``TokenConstraint`` is one sequence's matcher: ``mask``
gives the allowed tokens of the next step as a bool vector, ``advance`` feeds the sampled token, and the
next step's mask is computed at once on a worker thread, while the forward pass of that step runs.
"""

from __future__ import annotations

import json
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moed.errors import InvalidRequestError

KINDS = ("json_schema", "lark", "gbnf", "regex")
MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar or schema larger than this is refused (the compile is not free)
ANY_JSON_OBJECT = {"type": "object"}
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moed-grammar")


@dataclass(frozen=True)
class Grammar:
    """``kind`` (one of ``KINDS``) and its text: a JSON schema as JSON text, a Lark / GBNF grammar, a regex."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"grammar type {self.kind!r} is not supported; use one of {', '.join(KINDS)}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise InvalidRequestError(f"the {self.kind} grammar is empty")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"the {self.kind} grammar has {len(self.text)} characters; at most "
                                      f"{MAX_GRAMMAR_CHARS} are allowed")

    @classmethod
    def json_schema(cls, schema: Any) -> "Grammar":
        """Output that is one JSON value matching ``schema`` (a dict; ``{"type": "object"}`` for any object)."""
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    def llguidance(self) -> str:
        """The grammar in llguidance's form; an InvalidRequestError that quotes llguidance when it is invalid."""
        import llguidance

        text = self.text
        if self.kind == "json_schema":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the json_schema grammar is invalid: not JSON ({exc})") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("the json_schema grammar is invalid: a schema must be a JSON object")
            # JSON as json.dumps writes it (", " and ": ", no other whitespace): what models were trained on, and
            # no room for a weak model to pad its answer with newlines until max_tokens
            text = json.dumps({**schema, "x-guidance": {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}})
        try:
            return llguidance.grammar_from(self.kind, text)
        except (ValueError, RuntimeError) as exc:
            raise InvalidRequestError(f"the {self.kind} grammar is invalid: {exc}") from None


class GrammarTokenizer:
    """One model's tokenizer as llguidance sees it (its tokenizer.json, the model's vocabulary size and end
    tokens); makes the matchers of that model's requests."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))

    def constraint(self, grammar: Grammar) -> "TokenConstraint":
        """A fresh matcher of ``grammar``; raises InvalidRequestError (naming llguidance's reason) when the grammar
        does not compile or is unusable with this vocabulary."""
        import llguidance

        compiled = grammar.llguidance()
        ok, warnings_or_error = _validate(compiled, self._tokenizer)
        if not ok:
            raise InvalidRequestError(f"the {grammar.kind} grammar cannot be used: {warnings_or_error}")
        matcher = llguidance.LLMatcher(self._tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the {grammar.kind} grammar cannot be used: {matcher.get_error()}")
        return TokenConstraint(matcher, self.vocab_size)


def _validate(compiled: str, tokenizer) -> tuple[bool, str]:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, tokenizer)
    return (not is_error, "; ".join(messages))


_cache: "weakref.WeakKeyDictionary[object, GrammarTokenizer]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids) -> GrammarTokenizer:
    """The ``GrammarTokenizer`` of a model's tokenizer (``moed.text.tokenizer.Tokenizer``), built on first use."""
    with _cache_lock:
        found = _cache.get(tokenizer)
        if found is None or found.vocab_size != vocab_size:
            found = GrammarTokenizer(tokenizer.backend.to_str(), vocab_size, list(eos_ids))
            _cache[tokenizer] = found
        return found


class TokenConstraint:
    """One sequence's grammar state. ``mask()`` waits for the next step's allowed tokens (computed on a worker
    thread since the last ``advance``), ``advance(token)`` feeds the sampled token and starts the next mask."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        # the matcher is not thread-safe: nothing else touches it while a mask is computed on the worker, so
        # what the loop asks between steps (finished) is read before the next mask starts
        self._stopped = matcher.is_stopped()
        self._next: Future | None = _executor.submit(matcher.compute_bitmask)

    def mask(self) -> torch.Tensor:
        """bool ``[vocab_size]``: the tokens the grammar allows next (end tokens when it is complete)."""
        bits = self._next.result() if self._next is not None else self._matcher.compute_bitmask()
        self._next = None
        # bit t of the little-endian 32-bit words is token t: the bytes' bits, least significant first
        return torch.from_numpy(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")
                                [: self.vocab_size].view(np.bool_))

    def advance(self, token: int) -> bool:
        """Feed the sampled token; False when the grammar refused it (then the matcher is in error)."""
        if self._next is not None:  # a mask nobody asked for (a step skipped): never two users of the matcher
            self._next.result()
            self._next = None
        ok = self._matcher.consume_token(token)
        self._stopped = self._matcher.is_stopped()
        if ok and not self._stopped:
            self._next = _executor.submit(self._matcher.compute_bitmask)
        return ok

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits no further token: the output is done."""
        return self._stopped

    @property
    def error(self) -> str:
        if self._next is not None:
            self._next.result()
            self._next = None
        return self._matcher.get_error() if self._matcher.is_error() else ""


__all__ = ["ANY_JSON_OBJECT", "Grammar", "GrammarTokenizer", "KINDS", "TokenConstraint", "grammar_tokenizer"]
