"""`moed run NAME:TAG PROMPT` against a fake Ollama store laid out as Ollama writes it (issue #35): the daemon
resolves Ollama's name to its GGUF blob, loads it in place (the same inode; nothing written to the store), and
answers; `moed ps` shows it with the time it unloads; `moed models` lists the store's models."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T

from helpers.daemon_process import start_daemon
from helpers.gguf_writer import write_tiny_gguf
from helpers.model_stores import add_ollama_model


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    gguf, _, _ = write_tiny_gguf("qwen3_moe", tmp_path_factory.mktemp("build"), expert_type=T.Q8_0,
                                 weight_type=T.Q8_0, max_position_embeddings=512)
    blob = add_ollama_model(home / "ollama", gguf, "tiny-qwen:q8", move=True)
    d = start_daemon(home, "--device", "cpu", "--context", "256", "--keep-alive", "2m")
    d.blob = blob
    yield d
    assert d.stop() == 0, (d.home / "daemon.out").read_text()


def _moed(daemon, *args: str) -> subprocess.CompletedProcess:
    env = dict(daemon.env, MOED_SOCKET=str(daemon.socket))
    return subprocess.run([sys.executable, "-m", "moed.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=180)


def test_run_an_ollama_name_loads_the_blob_in_place(daemon):
    blob = daemon.blob
    inode, files = os.stat(blob).st_ino, sorted(p.name for p in blob.parent.iterdir())
    listed = _moed(daemon, "models")
    assert listed.returncode == 0 and "tiny-qwen:q8" in listed.stdout and "ollama" in listed.stdout, listed.stderr
    answer = _moed(daemon, "run", "tiny-qwen:q8", "The router reads", "--max-tokens", "5", "--temperature", "0")
    assert answer.returncode == 0 and "generated 5 tok" in answer.stderr, answer.stderr
    with daemon.client() as client:
        [model] = [m for m in client.list_models() if m.loaded]
    assert model.name == "tiny-qwen:q8" and model.source == "ollama" and model.path == str(blob)
    assert os.stat(model.path).st_ino == inode and sorted(p.name for p in blob.parent.iterdir()) == files
    ps = _moed(daemon, "ps")
    assert ps.returncode == 0 and "tiny-qwen:q8" in ps.stdout and "in 1 min" in ps.stdout, ps.stdout
    # loaded already: answered again, the same greedy answer each time. (The first answer prefilled the whole prompt;
    # these reuse its cached blocks, whose last token runs a decode-shaped step: on a random tiny q8 model the two
    # shapes' roundings may pick different near-tied tokens, as on AVX2-only CPUs.)
    again = _moed(daemon, "run", "tiny-qwen:q8", "The router reads", "--max-tokens", "5", "--temperature", "0")
    third = _moed(daemon, "run", "tiny-qwen:q8", "The router reads", "--max-tokens", "5", "--temperature", "0")
    assert again.returncode == 0 and "generated 5 tok" in again.stderr, again.stderr
    assert third.returncode == 0 and third.stdout == again.stdout
    latest = _moed(daemon, "run", "tiny-qwen", "The router reads")  # no tag means :latest, as in Ollama
    assert latest.returncode == 2 and "not found" in latest.stderr and "Ollama's store" in latest.stderr
