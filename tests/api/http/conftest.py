"""The HTTP API tests' default fixtures: a daemon serving the tiny model as "tiny", and an `openai` client to it.

A module that needs other models (scripted ones, a token) defines its own ``daemon`` (and ``client``),
which takes the place of these for that module.
"""

from __future__ import annotations

import pytest

from helpers.http_daemon import start_http_daemon
from helpers.tiny_models import build_tiny_model_dir


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_http_daemon(build_tiny_model_dir(tmp_path_factory.mktemp("models")), models=("tiny",))
    yield d
    d.close()


@pytest.fixture(scope="module")
def client(daemon):
    return daemon.openai()
