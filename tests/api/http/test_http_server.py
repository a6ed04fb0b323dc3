"""The gateway as a server: token check, where it may listen, clients that leave mid-answer, clean stops."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading

import openai
import pytest

from helpers.http_daemon import (GENERATION_PROMPT, ChatScriptedModel, add_scripted_model, start_http_daemon,
                                 tools_tokenizer)
from moed.api.http.server import HttpServer
from moed.errors import InvalidRequestError

TOKEN = "s3cret-token"
LONG = " ".join(["word"] * 150)
HI = [{"role": "user", "content": "Say many words"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tools_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def daemon(tokenizer):
    d = start_http_daemon(token=TOKEN)
    # slow enough that a client can leave while its answer is being written
    d.model = ChatScriptedModel(tokenizer, lambda prompt: LONG, step_delay_s=0.02)
    d.entry = add_scripted_model(d, "slow", d.model)
    yield d
    d.close()


def get(daemon, path: str, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(daemon.server.host, daemon.server.port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    return resp.status, body


def test_a_token_is_required_as_bearer_or_x_api_key(daemon):
    with pytest.raises(openai.AuthenticationError) as err:
        daemon.openai(api_key="wrong").models.list()
    assert err.value.status_code == 401 and "token is wrong" in err.value.body["message"]
    assert err.value.body["type"] == "authentication_error"
    status, body = get(daemon, "/v1/models")
    assert status == 401 and "no token was sent" in body["error"]["message"]
    assert get(daemon, "/v1/models", {"x-api-key": TOKEN})[0] == 200
    assert get(daemon, "/v1/models", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    assert [m.id for m in daemon.openai().models.list().data] == ["slow"]


def test_health_needs_no_token(daemon):
    status, body = get(daemon, "/health")
    assert status == 200 and body["status"] == "ok"


def test_a_non_loopback_address_needs_a_token(daemon):
    with pytest.raises(InvalidRequestError, match="needs a token"):
        HttpServer(daemon.ctx, "0.0.0.0:8080", None)
    with pytest.raises(InvalidRequestError, match="needs a token"):
        HttpServer(daemon.ctx, "example.com:8080", None)
    HttpServer(daemon.ctx, "0.0.0.0:8080", TOKEN)  # allowed (not started)
    for bad in ("localhost", "127.0.0.1:http", ":8080", "127.0.0.1:70000"):
        with pytest.raises(InvalidRequestError, match="HOST:PORT"):
            HttpServer(daemon.ctx, bad, None)


def test_a_port_in_use_is_a_clear_error(daemon):
    with pytest.raises(InvalidRequestError, match="cannot listen on"):
        HttpServer(daemon.ctx, daemon.server.address, None).start()


def test_a_client_that_leaves_mid_stream_cancels_its_request_and_others_are_served(daemon):
    client = daemon.openai()
    forwards_before = daemon.model.num_forwards
    stream = client.chat.completions.create(model="slow", messages=HI, max_tokens=150, stream=True)
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen >= 3:
            break
    stream.close()
    daemon.wait_idle()
    # the answer had 150 tokens to go; the loop stopped well before writing them all
    assert daemon.model.num_forwards - forwards_before < 140
    reply = client.chat.completions.create(model="slow", messages=HI, max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3


def test_a_client_that_leaves_before_a_whole_answer_cancels_it(daemon):
    forwards_before = daemon.model.num_forwards
    body = json.dumps({"model": "slow", "messages": HI, "max_tokens": 150}).encode()
    sock = socket.create_connection((daemon.server.host, daemon.server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    # wait until the request runs, then hang up without reading the answer
    while daemon.entry.loop.num_active == 0 and daemon.model.num_forwards - forwards_before < 5:
        threading.Event().wait(0.01)
    sock.close()
    daemon.wait_idle()
    assert daemon.model.num_forwards - forwards_before < 140


STREAMED = [("/v1/chat/completions", {"messages": HI, "max_tokens": 150}),
            ("/v1/responses", {"input": "Say many words", "max_output_tokens": 150}),
            ("/v1/messages", {"messages": HI, "max_tokens": 150})]


@pytest.mark.parametrize("path, body", STREAMED, ids=[p for p, _ in STREAMED])
def test_a_stream_whose_client_is_gone_before_its_first_byte_is_cancelled(daemon, path, body):
    """The request is queued before the response starts; sending its first byte fails (the client hung
    up), so the body's generator never runs: the response itself must cancel the request."""
    forwards_before = daemon.model.num_forwards
    raw = json.dumps({"model": "slow", "stream": True, **body}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {TOKEN}".encode()),
                         (b"content-length", str(len(raw)).encode())]}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        raise OSError("the client hung up")

    async def call():
        with pytest.raises(Exception):
            await daemon.server.app(scope, receive, send)

    asyncio.run(call())
    daemon.wait_idle()
    assert daemon.model.num_forwards - forwards_before < 140


@pytest.fixture
def streams_fail_after_three_events(monkeypatch):
    """Every generation stream raises (as a bug in decoding or parsing would) after its third event."""
    from moed.api.http.bridge import GenerationStream

    events = GenerationStream.events

    async def failing(self, **kwargs):
        n = 0
        async for event in events(self, **kwargs):
            n += event is not None
            if n > 3:
                raise ValueError("boom while decoding")
            yield event

    monkeypatch.setattr(GenerationStream, "events", failing)


def test_an_error_mid_stream_ends_each_stream_in_its_api_shape(daemon, streams_fail_after_three_events):
    client = daemon.openai()
    with pytest.raises(openai.APIError, match="boom while decoding"):
        list(client.chat.completions.create(model="slow", messages=HI, max_tokens=50, stream=True))
    with pytest.raises(openai.APIError, match="boom while decoding"):
        list(client.completions.create(model="slow", prompt=GENERATION_PROMPT, max_tokens=50, stream=True))
    events = list(client.responses.create(model="slow", input="Say many words", max_output_tokens=50, stream=True))
    assert events[-1].type == "response.failed" and "boom while decoding" in events[-1].response.error.message
    assert events[-1].response.status == "failed"
    with pytest.raises(Exception, match="boom while decoding"):
        with daemon.anthropic().messages.stream(model="slow", messages=HI, max_tokens=50) as stream:
            list(stream)
    daemon.wait_idle()


def test_stop_ends_open_streams_and_the_thread(tokenizer):
    d = start_http_daemon()
    add_scripted_model(d, "slow", ChatScriptedModel(tokenizer, lambda prompt: LONG, step_delay_s=0.02))
    client = d.openai()
    stream = client.chat.completions.create(model="slow", messages=HI, max_tokens=150, stream=True)
    next(iter(stream))
    address = (d.server.host, d.server.port)
    d.close()  # as `moed serve` does: stopping flag, models closed (requests cancelled), server stopped
    assert not d.server._thread.is_alive()
    with pytest.raises(openai.APIError, match="cancelled"):  # the stream ends with an error event, no hang
        list(stream)
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2).close()
