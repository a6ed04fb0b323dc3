"""Structured output through the official SDKs (issue #34): the tiny random model, which writes no JSON of its own,
answers every request with a value of the requested schema, 20 times of 20, sampled at temperature 1:
``client.chat.completions.parse(response_format=Model)``, ``client.responses.parse(text_format=Model)`` and
``anthropic.messages.parse(output_format=Model)`` return the SDK's parsed instance; ``json_object``, llama-server's
``grammar`` / ``json_schema`` on chat and completions follow too; a schema or grammar that cannot be compiled is a
400 naming the field, and the daemon goes on serving.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema  # what parse() sends
from pydantic import BaseModel, Field


class Weather(BaseModel):
    city: str = Field(max_length=16)
    days: int = Field(ge=1, le=9)
    units: Literal["metric", "imperial"]
    # a random model ends a string only when the schema's length bound does: bounded, the answers stay short
    warnings: list[Annotated[str, Field(max_length=10)]] = Field(max_length=2)


MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
ROUNDS = 20


def _fits(w: Weather) -> bool:
    return (isinstance(w, Weather) and len(w.city) <= 16 and 1 <= w.days <= 9 and len(w.warnings) <= 2
            and all(len(x) <= 10 for x in w.warnings))


def test_chat_completions_parse_returns_the_model_every_time(client):
    seen = set()
    for seed in range(ROUNDS):
        done = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Weather,
                                             temperature=1.0, seed=seed, max_tokens=200)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert _fits(choice.message.parsed), choice.message.content
        seen.add(choice.message.content)
    assert len(seen) > ROUNDS // 2  # sampled, inside the schema


def test_json_object_and_the_streamed_answer_parse(client):
    for seed in range(3):  # any object: a random model's keys are unbounded strings, so only the start is sure
        done = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=seed,
                                              max_tokens=40, response_format={"type": "json_object"})
        content, reason = done.choices[0].message.content, done.choices[0].finish_reason
        assert content.startswith('{') and (reason == "length" or isinstance(json.loads(content), dict)), content
    done = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.0, max_tokens=60,
                                          response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
                                              "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                                              "required": ["n"], "additionalProperties": False}}})
    assert set(json.loads(done.choices[0].message.content)) == {"n"}
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=5, max_tokens=200,
                                            stream=True, response_format={"type": "json_schema", "json_schema": {
                                                "name": "weather", "schema": to_strict_json_schema(Weather),
                                                "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert _fits(Weather.model_validate_json(text))


def test_responses_parse_returns_the_model_every_time(client):
    for seed in range(ROUNDS):
        done = client.responses.parse(model="tiny", input="Weather in Paris as JSON?", text_format=Weather,
                                      temperature=1.0, max_output_tokens=200, extra_body={"seed": seed})
        assert done.status == "completed", done
        assert _fits(done.output_parsed), done.output_text


class Verdict(BaseModel):
    """For Anthropic's SDK, which moves length and range bounds into descriptions (Claude's structured outputs do
    not take them): enums, booleans and arrays of enums, which it sends as they are."""

    units: Literal["metric", "imperial"]
    rain: bool
    level: Literal[1, 2, 3]
    tags: list[Literal["wind", "sun", "fog"]]


def test_anthropic_messages_parse_returns_the_model_every_time(daemon):
    client = daemon.anthropic()
    seen = set()
    for _ in range(ROUNDS):
        done = client.messages.parse(model="tiny", max_tokens=200, messages=MESSAGES, output_format=Verdict,
                                     extra_body={"temperature": 1.0})
        assert done.stop_reason == "end_turn", done
        assert isinstance(done.parsed_output, Verdict), done.content
        seen.add(done.content[0].text)
    assert len(seen) > 1


def test_llama_server_grammar_and_json_schema_on_completions_and_chat(client):
    done = client.completions.create(model="tiny", prompt="Answer:", max_tokens=40, temperature=1.0, seed=3,
                                     extra_body={"grammar": 'root ::= ("yes" | "no") ", " [0-9] [0-9]?'})
    assert re.fullmatch(r"(yes|no), [0-9][0-9]?", done.choices[0].text), done.choices[0].text
    done = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=4,
                                          extra_body={"grammar": {"type": "regex", "grammar": r"[A-Z][a-z]{2,8}!"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,8}!", done.choices[0].message.content)
    done = client.completions.create(model="tiny", prompt="JSON:", max_tokens=80, temperature=1.0, seed=5,
                                     extra_body={"json_schema": {"type": "array", "items": {"type": "integer"},
                                                                 "minItems": 2, "maxItems": 4}})
    value = json.loads(done.choices[0].text)
    assert isinstance(value, list) and 2 <= len(value) <= 4 and all(type(v) is int for v in value)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}},
     "response_format.json_schema.schema"),
    ({"grammar": {"type": "yaml", "grammar": "a"}}, "grammar"),
    ({"grammar": "root ::= undefined-rule"}, None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                          "properties": 7}}}}, None),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "response_format"),
])
def test_a_bad_constraint_is_a_400_and_the_daemon_goes_on(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, extra_body=extra)
    if param is not None:
        assert err.value.body.get("param") == param, err.value.body
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")
