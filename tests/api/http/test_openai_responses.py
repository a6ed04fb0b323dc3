"""POST /v1/responses (what Codex CLI speaks) on a tiny model, with the `openai` SDK's responses client."""

from __future__ import annotations

import openai
import pytest

from moed.engine.request import GenerationRequest
from moed.engine.sampling import SamplingParams

PROMPT = "The daemon loads the weights"
SYSTEM = "Answer briefly."


def engine_answer(daemon, max_tokens: int) -> tuple[str, int]:
    """Greedy text of the engine for the chat [system, user] (what `moed run --system` generates)."""
    entry = daemon.manager.get("tiny")
    prompt_ids = entry.runtime.encode_prompt(PROMPT, chat=True, system=SYSTEM)
    handle = entry.loop.submit(GenerationRequest("direct", prompt_ids, SamplingParams(max_tokens=max_tokens)))
    events = list(handle.events(timeout=30))
    return "".join(e.text for e in events), len(prompt_ids)


def test_response_text_equals_the_engine_and_usage_counts_tokens(daemon, client):
    expected, num_prompt = engine_answer(daemon, 10)
    response = client.responses.create(model="tiny", instructions=SYSTEM, input=PROMPT, max_output_tokens=10,
                                       temperature=0)
    assert response.output_text == expected
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == num_prompt and response.usage.output_tokens == 10
    assert response.usage.total_tokens == num_prompt + 10
    assert [item.type for item in response.output] == ["message"]
    # instructions as a developer message in the input render the same prompt
    same = client.responses.create(model="tiny", max_output_tokens=10, temperature=0, input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPT}]}])
    assert same.output_text == expected and same.usage.input_tokens == num_prompt


def test_streamed_response_has_the_event_sequence_and_the_same_text(daemon, client):
    expected, _ = engine_answer(daemon, 10)
    events = list(client.responses.create(model="tiny", instructions=SYSTEM, input=PROMPT, max_output_tokens=10,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected
    assert next(e for e in events if e.type == "response.output_text.done").text == expected
    final = events[-1].response
    assert final.output_text == expected and final.usage.output_tokens == 10
    assert events[0].response.id == final.id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "done"}


@pytest.mark.parametrize("body,field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_hologram", "data": "x"}]}]},
     "input[0].content"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    *[({"input": [CALL | {"arguments": value}, OUTPUT]}, "input[0].arguments") for value in (-1, True, [1])],
    *[({"input": [CALL, OUTPUT | {"call_id": value}]}, "input[1].call_id") for value in ({}, [None], 5)],
    *[({"input": [CALL, OUTPUT | {"output": value}]}, "input[1].output") for value in (5, None, {"a": 1})],
    *[({"input": [{"type": "reasoning", "content": value}, CALL, OUTPUT]}, "input[0].content")
      for value in (5, "text", [5])],
])
def test_bad_responses_requests_are_400s_naming_the_field(client, body, field):
    kwargs = {"model": "tiny", "input": PROMPT, **body}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == field or field.split("[")[0] in err.value.body["message"]
