"""JsonStream: accepts exactly the JSON values json.loads accepts, char by char, and knows where they end."""

from __future__ import annotations

import json
import random

import pytest

from moed.text.output_parsers.json_stream import JsonStream, JsonSyntaxError


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] * 2 if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -1.25e-7, 3.0e12, rng.uniform(-1e3, 1e3)])
    if kind == "str":
        return "".join(rng.choice('ab "\\/\n\t{}[]:,é日🙂\x01') for _ in range(rng.randint(0, 8)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {"k" + str(i) + rng.choice('xy"'): random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}


def accepts(text: str) -> bool:
    """Whether JsonStream takes text as one complete value (surrounding whitespace allowed)."""
    stream = JsonStream()
    try:
        end = stream.feed(text)
    except JsonSyntaxError:
        return False
    return stream.is_complete_at_end() and not text[end:].strip(" \t\n\r")


def json_loads_accepts(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_valid_documents_are_accepted_in_any_split_and_end_where_they_end():
    rng = random.Random(7)
    for _ in range(300):
        value = random_value(rng)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        stream = JsonStream()
        pos = 0
        while pos < len(text):  # random piece sizes: every prefix is valid
            step = rng.randint(1, 5)
            assert stream.feed(text[: pos + step], pos) == min(pos + step, len(text)) or stream.done
            pos += step
        assert stream.is_complete_at_end()
        if isinstance(value, (dict, list, str)) or value is None or isinstance(value, bool):
            assert stream.done and JsonStream().feed(text + "} tail") == len(text)


def test_agrees_with_json_loads_on_mutated_documents():
    rng = random.Random(11)
    alphabet = '{}[]":,0123456789-+.eEtrufalsn \\u\n'
    seen = {True: 0, False: 0}
    for _ in range(3000):
        text = json.dumps(random_value(rng))
        for _ in range(rng.randint(1, 3)):  # delete, insert or replace a char
            i = rng.randrange(len(text) + 1)
            op = rng.randrange(3)
            if op == 0 and text:
                text = text[:i] + text[i + 1:]
            elif op == 1:
                text = text[:i] + rng.choice(alphabet) + text[i:]
            elif text:
                text = text[:i] + rng.choice(alphabet) + text[i + 1:]
        expected = json_loads_accepts(text)
        assert accepts(text) == expected, repr(text)
        seen[expected] += 1
    assert min(seen.values()) > 300  # both outcomes were exercised


@pytest.mark.parametrize("text", ["{'a': 1}", "{a: 1}", "[1,]", "{\"a\" 1}", "01", "1.", "-", "tru", "\"\\x\"",
                                  "\"a\nb\"", "{\"a\": 1,}", "[1 2]", "nul", "\"\\u12g4\""])
def test_rejects(text):
    assert not accepts(text) and not json_loads_accepts(text)


def test_require_object_and_top_keys():
    with pytest.raises(JsonSyntaxError):
        JsonStream(require_object=True).feed("  [1]")
    stream = JsonStream(require_object=True)
    stream.feed('{"a": {"b": 1}, "c"')
    assert stream.top_keys == 2 and stream.depth == 1 and not stream.done
    assert stream.feed(': 2} more', 0) == len(': 2}') and stream.done


def test_number_at_top_level_ends_at_the_next_char():
    stream = JsonStream()
    assert stream.feed("12.5e3") == 6 and not stream.done and stream.is_complete_at_end()
    assert stream.feed(",") == 0 and stream.done
