"""Structured output and forced tool calls on the demo model (issue #34's acceptance "on the demo model too"):
the real SmolLM2-135M upcycled into a Mixtral, q8 experts as `make demo` converts it, behind the daemon's HTTP
API, sampled at temperature 1: the SDKs' parse() return their model and a forced tool choice gives a schema-valid
call, 20 times of 20 (OpenAI Chat) and 5 of 5 (Responses, Anthropic)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from helpers.http_daemon import start_http_daemon
from moed.engine.model_manager import LoadOptions

MODEL = "demo-moe-ftw"
ASK = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


class Capital(BaseModel):
    country: Annotated[str, Field(max_length=40)]
    capital: Annotated[str, Field(max_length=40)]
    confidence: Literal["low", "medium", "high"]


LOOKUP = {"type": "function", "function": {"name": "lookup_capital", "description": "The capital of a country",
                                           "parameters": {"type": "object", "properties": {
                                               "country": {"type": "string", "maxLength": 40}},
                                               "required": ["country"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def daemon(demo_models_dir):
    d = start_http_daemon(demo_models_dir, models=(MODEL,),
                          options=LoadOptions(device="cpu", max_batch=4, context_length=2048))
    yield d
    d.close()


def test_chat_parse_and_forced_calls_twenty_times_of_twenty(daemon):
    client = daemon.openai()
    for seed in range(20):
        done = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Capital, temperature=1.0,
                                             seed=seed, max_tokens=120)
        assert isinstance(done.choices[0].message.parsed, Capital), done.choices[0].message.content
    for seed in range(20):
        done = client.chat.completions.create(model=MODEL, messages=ASK, tools=[LOOKUP], tool_choice="required",
                                              temperature=1.0, seed=seed, max_tokens=120, parallel_tool_calls=False)
        calls = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls" and len(calls) == 1, done.choices[0]
        arguments = json.loads(calls[0].function.arguments)
        assert calls[0].function.name == "lookup_capital" and set(arguments) == {"country"}
        assert isinstance(arguments["country"], str) and len(arguments["country"]) <= 40


def test_responses_and_anthropic_on_the_demo_model(daemon):
    client = daemon.openai()
    for seed in range(5):
        done = client.responses.parse(model=MODEL, input=ASK[0]["content"], text_format=Capital, temperature=1.0,
                                      max_output_tokens=120, extra_body={"seed": seed})
        assert isinstance(done.output_parsed, Capital), done.output_text
    anthropic = daemon.anthropic()
    tool = {"name": "lookup_capital", "description": "The capital of a country",
            "input_schema": LOOKUP["function"]["parameters"]}
    for _ in range(5):
        done = anthropic.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[tool],
                                         tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                         extra_body={"temperature": 1.0})
        uses = [b for b in done.content if b.type == "tool_use"]
        assert done.stop_reason == "tool_use" and len(uses) == 1 and set(uses[0].input) == {"country"}
