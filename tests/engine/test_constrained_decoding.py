"""Constrained decoding on the engine loop (issue #34): a tiny random model, which on its own writes no JSON,
answers with a value matching the request's JSON schema, regex or Lark/GBNF grammar, sampled (temperature 1) or
greedy, alone and batched with unconstrained requests; a bad grammar is refused before anything is queued.

The checks are the standard library's: ``json.loads`` and a schema check written here, ``re.fullmatch``.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.engine_loop import EngineLoop
from moed.engine.request import GenerationRequest
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError
from moed.text.grammar import Grammar, TokenConstraint, grammar_tokenizer

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "units": {"enum": ["metric", "imperial"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["city", "days", "units"], "additionalProperties": False}


def _fits(value) -> bool:
    """SCHEMA, checked by hand."""
    return (isinstance(value, dict) and set(value) <= {"city", "days", "units", "tags"}
            and {"city", "days", "units"} <= set(value) and isinstance(value["city"], str)
            and len(value["city"]) <= 12 and type(value["days"]) is int and 1 <= value["days"] <= 9
            and value["units"] in ("metric", "imperial")
            and all(type(t) is bool for t in value.get("tags", [])) and len(value.get("tags", [])) <= 3)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    build_tiny_model("qwen3_moe", path)
    write_tiny_tokenizer(path)
    rt = open_runtime(path)
    yield rt
    rt.close()


def _run(runtime, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple[str, str]]:
    loop = EngineLoop(runtime, name="grammar", max_batch=8, context_length=256)
    handles = [loop.submit(GenerationRequest(f"r{i}", prompt, params)) for i, (prompt, params) in enumerate(requests)]
    loop.start()
    try:
        out = []
        for h in handles:
            events = list(h.events(timeout=120))
            out.append(("".join(e.text for e in events), events[-1].finish_reason))
        return out
    finally:
        loop.stop()


def test_json_schema_output_is_valid_twenty_times_of_twenty(runtime):
    """Sampled at temperature 1 from a random model, batched 10 at a time with unconstrained requests: every
    constrained answer parses and fits the schema, and ends by itself (the grammar's end), not by length."""
    tok = runtime.tokenizer
    prompt = tok.encode("<|im_start|>user\nWeather as JSON?<|im_end|>\n<|im_start|>assistant\n")
    grammar = Grammar.json_schema(SCHEMA)
    answers = []
    for round_ in range(2):
        reqs = [(prompt, SamplingParams(temperature=1.0, seed=100 * round_ + i, max_tokens=120, grammar=grammar))
                for i in range(10)]
        reqs.insert(3, (prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=20)))
        results = _run(runtime, reqs)
        free_text, _ = results.pop(3)
        assert free_text  # the unconstrained neighbour still writes whatever it likes
        answers += results
    for text, reason in answers:
        assert reason == "eos", (text, reason)
        assert _fits(json.loads(text)), text
    assert len({text for text, _ in answers}) > 5  # sampling still samples, inside the grammar


def test_unconstrained_output_of_this_model_is_not_json(runtime):
    """The control: without a grammar the same model does not write JSON, so the test above can fail."""
    tok = runtime.tokenizer
    prompt = tok.encode("<|im_start|>user\nWeather as JSON?<|im_end|>\n<|im_start|>assistant\n")
    for text, _ in _run(runtime, [(prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=40)) for s in range(4)]):
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("kind, grammar, check", [
    ("regex", r"(yes|no), [0-9]{2,4} (apples|pears)", lambda t: re.fullmatch(r"(yes|no), [0-9]{2,4} (apples|pears)", t)),
    ("lark", 'start: "colour: " COLOUR ("," COLOUR)*\nCOLOUR: "red" | "green" | "blue"',
     lambda t: re.fullmatch(r"colour: (red|green|blue)(,(red|green|blue))*", t)),
    ("gbnf", 'root ::= "n=" [1-9] [0-9]? " " ("ok" | "bad")', lambda t: re.fullmatch(r"n=[1-9][0-9]? (ok|bad)", t)),
])
def test_regex_lark_and_gbnf_grammars(runtime, kind, grammar, check):
    prompt = runtime.tokenizer.encode("<|im_start|>user\nAnswer.<|im_end|>\n<|im_start|>assistant\n")
    params = [SamplingParams(temperature=t, seed=s, max_tokens=60, grammar=Grammar(kind, grammar))
              for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    for text, reason in _run(runtime, [(prompt, p) for p in params]):
        assert check(text), (kind, text, reason)


@pytest.mark.parametrize("kind, text, says", [
    ("json_schema", '{"type": "object", "properties": 5}', "properties must be an object"),
    ("json_schema", "{not json", "invalid"),
    ("regex", "(unclosed", "invalid"),
    ("lark", "start: missing_rule", "missing_rule"),
    ("gbnf", "root ::= undefined-rule", "undefined"),
])
def test_a_bad_grammar_is_refused_before_it_is_queued(runtime, kind, text, says):
    loop = EngineLoop(runtime, name="bad", max_batch=2, context_length=128)
    with pytest.raises(InvalidRequestError, match=says):
        loop.submit(GenerationRequest("bad", [5, 6, 7], SamplingParams(grammar=Grammar(kind, text))))


def test_the_mask_allows_exactly_the_grammars_next_tokens(runtime):
    """The matcher's mask against the tokenizer: after '{"city": "' a quote-free letter is allowed and '}' is not;
    once the object is complete only the end tokens are."""
    tok = runtime.tokenizer
    vocab = runtime.loaded.config.vocab_size
    gt = grammar_tokenizer(tok, vocab, {3})
    c: TokenConstraint = gt.constraint(Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                            "required": ["a"], "additionalProperties": False}))
    first = c.mask()
    assert first.shape == (vocab,) and bool(first[tok.encode("{")[0]]) and not bool(first[tok.encode("x")[0]])
    for t in tok.encode('{"a": 12}'):
        assert c.mask()[t], tok.decode([t])
        assert c.advance(t)
    end = c.mask() if not c.finished else torch.zeros(vocab, dtype=torch.bool)
    assert c.finished or int(end.sum()) <= 3


def test_invalid_grammar_kinds_and_sizes_are_refused():
    with pytest.raises(InvalidRequestError, match="not supported"):
        Grammar("yaml", "a: 1")
    with pytest.raises(InvalidRequestError, match="at most"):
        Grammar("regex", "a" * (300 * 1024))
    with pytest.raises(InvalidRequestError, match="empty"):
        Grammar("lark", "  ")
