"""The access log: one line per HTTP request with the model, token figures, timing and any error."""

from __future__ import annotations

import logging
import re
import time

import openai
import pytest


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "moed.access"]


def test_each_request_leaves_one_line_with_its_figures(daemon, client, caplog):
    caplog.set_level(logging.INFO, logger="moed.access")
    messages = [{"role": "user", "content": "The router reads"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    for _ in client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0, stream=True):
        pass
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages, max_tokens=4)
    client.models.list()
    lines = _lines(caplog)
    assert len(lines) == 4, lines
    whole, streamed, missing, models = lines
    assert re.match(r'127\.0\.0\.1:\d+ "POST /v1/chat/completions" 200 model=tiny prompt=\d+ cached=\d+ generated=4 '
                    r'ttft=\d+\.\d\ds time=\d+\.\d\ds finish=length$', whole), whole
    assert '"POST /v1/chat/completions" 200 model=tiny' in streamed
    assert '" 404 ' in missing and "error=" in missing and "nope" in missing
    assert '"GET /v1/models" 200' in models


def test_a_failure_mid_stream_is_in_the_line(daemon, client, caplog):
    caplog.set_level(logging.INFO, logger="moed.access")
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=long, max_tokens=4, stream=True)
    line = _lines(caplog)[-1]
    assert '" 400 ' in line and "prompt is too long" in line


def test_a_client_that_leaves_mid_answer_is_logged_with_what_it_got(daemon, client, caplog):
    caplog.set_level(logging.INFO, logger="moed.access")
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 2:
            break
    stream.close()
    daemon.wait_idle()
    deadline = time.monotonic() + 10
    while not any("client_left" in line for line in _lines(caplog)) and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(line for line in _lines(caplog) if "client_left" in line)
    assert re.search(r"generated=(\d+)", line) and int(re.search(r"generated=(\d+)", line).group(1)) >= 2, line
