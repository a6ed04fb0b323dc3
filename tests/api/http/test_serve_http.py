"""`moed serve --http`: the gateway in a real daemon process, next to gRPC, stopped with the daemon."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from helpers.daemon_process import start_daemon
from helpers.tiny_models import build_tiny_model_dir


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("models"))


def http_url(daemon) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"http://127\.0\.0\.1:\d+", (daemon.home / "daemon.out").read_text())
        if found:
            return found.group(0)
        time.sleep(0.05)
    raise AssertionError((daemon.home / "daemon.out").read_text())


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_serve_http_answers_openai_clients_and_gRPC_alike_then_stops(tmp_path, models_dir):
    import openai

    daemon = start_daemon(tmp_path / "home", "--http", "127.0.0.1:0", "--model", "tiny", "--device", "cpu",
                          models_dir=models_dir)
    try:
        url = http_url(daemon)
        deadline = time.monotonic() + 60
        while (status := health(url))[0] != 200 or status[1]["models"] != ["tiny"]:
            assert status[0] in (200, 503), status
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "The GPU"}],
                                               max_tokens=6, temperature=0)
        with daemon.client() as grpc_client:
            grpc_text = "".join(p.text for p in grpc_client.generate(
                messages=[{"role": "user", "content": "The GPU"}], model="tiny", max_tokens=6))
        assert reply.choices[0].message.content == grpc_text  # one engine behind both
        with daemon.client() as grpc_client:  # where `moed launch` and `moed status` learn the address
            assert grpc_client.status().http_url == url
    finally:
        assert daemon.stop() == 0, (daemon.home / "daemon.out").read_text()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)


def test_serve_refuses_a_public_http_address_without_a_token(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moed.cli.main", "serve", "--socket", str(tmp_path / "s.sock"),
                             "--http", "0.0.0.0:0"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "MOED_RUNTIME_DIR": str(tmp_path / "run"),
                                 "MOED_LOG_DIR": str(tmp_path / "logs"), "MOED_TOKEN": "",
                                 "MOED_TOKEN_FILE": ""})
    assert result.returncode == 2
    assert "--http 0.0.0.0:0: listening beyond this machine needs a token" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
