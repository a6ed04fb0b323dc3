"""Every parameter of the official SDKs' requests is honoured, has no effect on the answer by its nature, or is a
400 that names it (issue #34; docs/api.md has the same lists with the reasons). A parameter a new SDK version adds
fails the first test of its API until it is placed in one of the three lists."""

from __future__ import annotations

import inspect

import pytest
from anthropic.resources.messages import Messages
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions
from openai.resources.responses import Responses

from helpers.http_daemon import post_json

SKIP = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
MESSAGES = [{"role": "user", "content": "hi"}]

# honoured: each is tested where its feature is (test_structured_output, test_forced_tool_calls, test_logprobs,
# test_sampling_params, test_choices, test_reasoning_budget, test_openai_api, test_anthropic_messages ...)
APIS = {
    "chat": dict(
        create=ChatCompletions.create,
        honoured={"messages", "model", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
                  "max_tokens", "n", "parallel_tool_calls", "presence_penalty", "reasoning_effort", "response_format",
                  "seed", "stop", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
                  "top_p"},
        no_effect={"metadata", "moderation", "prediction", "prompt_cache_key", "prompt_cache_options",
                   "prompt_cache_retention", "safety_identifier", "service_tier", "store", "user", "verbosity"},
        refused={"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
                 "web_search_options": {"search_context_size": "low"}, "function_call": "auto",
                 "functions": [{"name": "f", "parameters": {"type": "object"}}]}),
    "completions": dict(
        create=Completions.create,
        honoured={"model", "prompt", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
                  "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p"},
        no_effect={"user"},
        refused={"best_of": 2, "echo": True, "suffix": "end"}),
    "responses": dict(
        create=Responses.create,
        honoured={"include", "input", "instructions", "max_output_tokens", "model", "parallel_tool_calls", "reasoning",
                  "stream", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p"},
        no_effect={"access_programs", "context_management", "image", "metadata", "moderation", "prompt_cache_key",
                   "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "service_tier", "store",
                   "stream_options", "user"},
        refused={"background": True, "background_options": {"priority": "low"}, "conversation": "conv_1", "prompt": {"id": "pmpt_1"}, "max_tool_calls": 3,
                 "previous_response_id": "resp_1", "truncation": "auto"}),
    "messages": dict(
        create=Messages.create,
        honoured={"max_tokens", "messages", "model", "output_config", "stop_sequences", "stream", "system", "thinking",
                  "tool_choice", "tools"},
        no_effect={"cache_control", "diagnostics", "inference_geo", "metadata", "service_tier", "speed",
                   "user_profile_id", "workspace_id"},
        refused={"container": "container_1"}),
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}
BASE = {"chat": {"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
        "completions": {"model": "tiny", "prompt": "hi", "max_tokens": 2},
        "responses": {"model": "tiny", "input": "hi", "max_output_tokens": 2},
        "messages": {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}}
NO_EFFECT_VALUES = {"metadata": {"k": "v"}, "prompt_cache_key": "key", "safety_identifier": "who", "service_tier": "auto",
                    "store": False, "user": "me", "verbosity": "low", "prediction": {"type": "content", "content": "x"},
                    "prompt_cache_retention": "24h", "inference_geo": "us", "speed": "standard"}


@pytest.mark.parametrize("api", sorted(APIS))
def test_every_sdk_parameter_is_placed(api):
    spec = APIS[api]
    params = set(inspect.signature(spec["create"]).parameters) - SKIP
    placed = spec["honoured"] | spec["no_effect"] | set(spec["refused"])
    assert params - placed == set(), f"{api}: parameters nobody decided about"
    assert placed - params == set(), f"{api}: listed but not in the SDK any more"
    assert not (spec["honoured"] & spec["no_effect"]) and not (spec["honoured"] & set(spec["refused"]))


@pytest.mark.parametrize("api, field", [(a, f) for a in sorted(APIS) for f in sorted(APIS[a]["refused"])])
def test_a_refused_parameter_is_a_400_naming_it(daemon, api, field):
    status, answer = post_json(daemon, PATHS[api], {**BASE[api], field: APIS[api]["refused"][field]})
    assert status == 400, (api, field, answer)
    assert field in str(answer), answer


@pytest.mark.parametrize("api, field", [(a, f) for a in sorted(APIS) for f in sorted(APIS[a]["no_effect"])
                                        if f in NO_EFFECT_VALUES])
def test_a_parameter_without_effect_is_accepted(daemon, api, field):
    status, answer = post_json(daemon, PATHS[api], {**BASE[api], field: NO_EFFECT_VALUES[field]})
    assert status == 200, (api, field, answer)
