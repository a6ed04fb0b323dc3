"""Fixtures for the tray tests: a tiny model directory and a real daemon on a temporary socket."""

from __future__ import annotations

import pytest

from helpers.daemon_process import start_daemon
from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer


@pytest.fixture(scope="session")
def tray_models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tray-models")
    build_tiny_model("mixtral", root / "tiny")
    write_tiny_tokenizer(root / "tiny")
    return root


@pytest.fixture
def daemon(tmp_path_factory, tray_models_dir):
    # short base path: AF_UNIX socket paths are limited to ~104 bytes
    d = start_daemon(tmp_path_factory.mktemp("d"), models_dir=tray_models_dir)
    yield d
    d.stop()
