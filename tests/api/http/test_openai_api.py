"""The OpenAI-compatible API on a tiny model, with the official `openai` SDK as the client."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from moed.engine.request import GenerationRequest
from moed.engine.sampling import SamplingParams

PROMPT = "The router reads"


def engine_text(daemon, prompt_ids: list[int], max_tokens: int, stop=()) -> tuple[str, str, int]:
    """What the engine itself generates greedily (the path of `moed run`): text, finish reason, tokens."""
    entry = daemon.manager.get("tiny")
    handle = entry.loop.submit(GenerationRequest("direct", prompt_ids, SamplingParams(max_tokens=max_tokens,
                                                                                      stop=tuple(stop))))
    events = list(handle.events(timeout=30))
    return "".join(e.text for e in events), events[-1].finish_reason, events[-1].usage.completion_tokens


def raw_post(daemon, path: str, body, headers: dict | None = None) -> tuple[int, dict | str, dict]:
    """POST with the standard library: status, parsed JSON (or text), headers."""
    conn = http.client.HTTPConnection(daemon.server.host, daemon.server.port, timeout=30)
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text), dict(resp.getheaders())
    except json.JSONDecodeError:
        return resp.status, text, dict(resp.getheaders())


def test_models_list_names_the_loaded_model_with_its_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].owned_by == "moed"
    assert models[0].model_extra["context_length"] == 256


def test_chat_greedy_text_equals_the_engine_and_the_stream_concatenates_to_it(daemon, client):
    messages = [{"role": "user", "content": PROMPT}]
    entry = daemon.manager.get("tiny")
    prompt_ids = entry.runtime.encode_prompt(PROMPT, chat=True)
    expected, reason, n = engine_text(daemon, prompt_ids, 12)
    assert reason == "length" and n == 12

    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, seed=7)
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == len(prompt_ids)
    # the engine's run left the prompt in the prefix cache: all its whole blocks but the last token's are reused
    assert answer.usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // 16 * 16 > 0
    assert answer.usage.completion_tokens == 12
    assert answer.usage.total_tokens == len(prompt_ids) + 12

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 seed=7, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_is_sse_ending_in_done(daemon):
    status, text, headers = raw_post(daemon, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True,
        "temperature": 0})  # greedy: this prompt does not end within 3 tokens (sampling could draw EOS)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"  # no usage chunk unless asked


def test_completions_plain_prompt_whole_and_streamed(daemon, client):
    entry = daemon.manager.get("tiny")
    expected, _, _ = engine_text(daemon, entry.runtime.tokenizer.encode(PROMPT), 8)
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer.choices[0].text == expected
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 8
    assert answer.usage.prompt_tokens == len(entry.runtime.tokenizer.encode(PROMPT))
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_answer_before_it(daemon, client):
    messages = [{"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stop=stop)
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    listed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stop=["\x01never", stop])
    assert listed.choices[0].message.content == text[:text.index(stop)]


def test_default_model_name_is_accepted_when_one_model_is_loaded(client):
    answer = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2)
    assert answer.model == "tiny"


def test_too_many_choices_is_a_400_in_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="Hi", n=99)
    assert err.value.status_code == 400
    assert err.value.body["param"] == "n" and "n=99" in err.value.body["message"]
    assert err.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_a_404_naming_the_loaded_ones(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-7", messages=[{"role": "user", "content": "Hi"}])
    assert "'gpt-7'" in err.value.body["message"] and "tiny" in err.value.body["message"]
    assert err.value.body["code"] == "model_not_found"


def test_a_prompt_over_the_context_is_a_400_with_code_context_length_exceeded(client):
    long = [{"role": "user", "content": "word " * 300}]
    for call in (lambda: client.chat.completions.create(model="tiny", messages=long),
                 lambda: list(client.chat.completions.create(model="tiny", messages=long, stream=True)),
                 lambda: client.responses.create(model="tiny", input=long[0]["content"]),
                 lambda: client.completions.create(model="tiny", prompt=long[0]["content"])):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.body["code"] == "context_length_exceeded"  # agents compact the conversation on it
        assert "prompt is too long" in err.value.body["message"] and "256" in err.value.body["message"]


@pytest.mark.parametrize("field,value", [("temperature", -1), ("temperature", 3), ("top_p", 0), ("max_tokens", 0),
                                         ("stop", [""])])
def test_out_of_range_sampling_is_a_400_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                       **{field: value})
    assert field.split("_")[0] in err.value.body["message"]
    if field != "stop":  # the engine's own check of stop strings names no field
        assert err.value.body["param"] == field


def test_malformed_bodies_get_400s_in_openai_shape_and_the_server_keeps_serving(daemon, client):
    bad = [b"{not json", b"[]", b'"text"', {"model": "tiny"}, {"model": "tiny", "messages": []},
           {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
           {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
           {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "audio_clip", "data": {}}]}]},
           {"model": "tiny", "messages": [{"role": "tool", "content": "x", "tool_call_id": "nope"}]},
           {"model": 5, "messages": [{"role": "user", "content": "x"}]},
           {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}]
    for body in bad:
        status, answer, _ = raw_post(daemon, "/v1/chat/completions", body)
        assert status == 400, (body, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert answer["error"]["type"] == "invalid_request_error"
    status, answer, _ = raw_post(daemon, "/v1/nothing", {})
    assert status == 404 and "no such endpoint" in answer["error"]["message"]
    assert answer["error"]["code"] is None  # no model is missing: the path is wrong
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                          temperature=0).choices[0].finish_reason == "length"


def test_health_is_open_and_says_ok(daemon):
    conn = http.client.HTTPConnection(daemon.server.host, daemon.server.port, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 200 and body["status"] == "ok" and body["models"] == ["tiny"]


def test_paused_daemon_answers_503(daemon, client):
    daemon.ctx.paused = True
    try:
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 503 and "paused" in err.value.body["message"]
    finally:
        daemon.ctx.paused = False


def test_eight_concurrent_http_streams_and_a_grpc_stream_equal_single_runs(daemon, client, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from moed.api.client import MoedClient
    from moed.api.server import DaemonServer, ServerConfig

    prompts = ["The router reads", "A small expert", "The daemon loads", "Every token", "The GPU",
               "Our cache keeps", "The user writes", "The scheduler finds"]

    def stream(prompt: str) -> str:
        chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=10, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = {p: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                               max_tokens=10, temperature=0).choices[0].message.content
             for p in prompts}
    grpc_server = DaemonServer(daemon.ctx, ServerConfig(socket_path=tmp_path / "moed.sock"))
    grpc_server.start()
    try:
        with MoedClient(f"unix://{tmp_path / 'moed.sock'}") as grpc_client, ThreadPoolExecutor(9) as pool:
            grpc_text = pool.submit(lambda: "".join(
                part.text for part in grpc_client.generate(messages=[{"role": "user", "content": prompts[0]}],
                                                           model="tiny", max_tokens=10)))
            together = dict(zip(prompts, pool.map(stream, prompts)))
            assert grpc_text.result() == alone[prompts[0]]
    finally:
        grpc_server.stop()
    assert together == alone
    assert daemon.manager.get("tiny").loop.max_batch_seen > 1  # they did share steps
    daemon.wait_idle()


def malformed_bodies() -> list[tuple[str, object]]:
    """(path, body): a valid request of each endpoint with one field made wrong, plus broken shapes."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    completion = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    response = {"model": "tiny", "input": "Hi", "max_output_tokens": 2}
    wrong = {
        "/v1/chat/completions": (chat, {
            "model": [5, [], {}], "messages": [None, "Hi", [], [{}], [{"role": "user"}], [{"content": "x"}],
                                               [{"role": 1, "content": "x"}], [{"role": "user", "content": {}}],
                                               [{"role": "assistant", "tool_calls": "x"}]],
            "max_tokens": [-1, 0, "2", 2.5], "max_completion_tokens": [0, "x"],
            "temperature": [-0.5, 2.5, "hot", []], "top_p": [0, 1.5, "x"], "stop": [5, [1], [""], {}],
            "seed": [-1, "x", 2**65], "n": [0, 17, "1"], "stream": ["yes", 1, {}],
            "stream_options": ["x", {"include_usage": "yes"}], "tools": ["x", [{"type": "function"}], [5]],
            "tool_choice": ["always", 5, {"type": "function"}], "logprobs": [5, "yes"], "top_logprobs": [21, -1],
            "response_format": [{"type": "xml"}], "logit_bias": [{"a": 1}, {"5": 200}], "presence_penalty": [3]}),
        "/v1/completions": (completion, {
            "prompt": [None, 5, [], ["a", "b"], {}], "max_tokens": [0, "x"], "echo": [True],
            "suffix": ["x"], "best_of": [2], "temperature": [-1], "n": [17]}),
        "/v1/responses": (response, {
            "input": [None, 5, [], [5], [{"type": "bogus"}], [{"role": "robot", "content": "x"}]],
            "max_output_tokens": [0, "x"], "temperature": [9], "tools": ["x", [5]],
            "previous_response_id": ["resp_x"], "tool_choice": ["sometimes"]}),
    }
    out: list[tuple[str, object]] = []
    for path, (valid, fields) in wrong.items():
        for field, values in fields.items():
            out += [(path, {**valid, field: value}) for value in values]
        out += [(path, {k: v for k, v in valid.items() if k != key}) for key in valid if key not in
                ("model", "max_tokens", "max_output_tokens")]  # a required field left out
        out += [(path, b"{"), (path, b"[1, 2]"), (path, b"null"), (path, b"\xff\xfe")]
    return out


def test_many_malformed_requests_are_400s_and_the_daemon_keeps_serving(daemon, client):
    bodies = malformed_bodies()
    assert len(bodies) >= 50
    for path, body in bodies:
        status, answer, _ = raw_post(daemon, path, body)
        assert status == 400, (path, body, answer)
        error = answer["error"]
        assert error["type"] == "invalid_request_error" and error["message"], (path, body, answer)
        assert "\n" not in error["message"] and len(error["message"]) <= 1000
    daemon.wait_idle()
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=1).usage.completion_tokens == 1
