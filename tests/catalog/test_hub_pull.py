"""`moed pull` against a local server shaped like the Hugging Face Hub (HF_ENDPOINT): a GGUF by its quant tag and
a safetensors repository land in the Hugging Face cache where the catalog finds them by name; a killed transfer
resumes where it stopped (a Range request); a file that fails its SHA-256 is deleted and the pull fails; an
unreachable Hub and a missing tag are clear errors (issue #35)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from helpers.fake_hub import FakeHub
from helpers.gguf_writer import write_tiny_gguf
from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.catalog.catalog import Catalog, CatalogRoots
from moed.catalog.hub_pull import parse_name
from moed.errors import InvalidRequestError

BIG = 12 << 20  # a GGUF padded to 12 MiB: on a slow link the transfer is killed midway


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    gguf, _, _ = write_tiny_gguf("qwen3_moe", root / "build", expert_type=T.Q8_0, weight_type=T.Q8_0)
    data = gguf.read_bytes()
    build_tiny_model("qwen3_moe", root / "st")
    write_tiny_tokenizer(root / "st")
    server = FakeHub().start()
    server.add_repo("org/Tiny-GGUF", {"Tiny-Q8_0.gguf": data, "Tiny-Q4_K_M.gguf": data + b"\0" * 64,
                                      "Big-Q6_K.gguf": data + b"\0" * (BIG - len(data)), "README.md": b"# tiny"})
    server.add_repo("org/tiny-st", {p.name: p for p in (root / "st").iterdir() if p.is_file()})
    yield server
    server.stop()


def _pull(hub: FakeHub, cache: Path, *args: str, wait: bool = True):
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(cache), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5")
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # other tests' modules set them in this process
        env.pop(key, None)
    cmd = [sys.executable, "-m", "moed.cli.main", "pull", *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def test_a_gguf_by_its_tag_lands_where_the_catalog_finds_it(hub, tmp_path):
    done = _pull(hub, tmp_path, "org/Tiny-GGUF:q8_0")
    assert done.returncode == 0, done.stderr
    assert "pulled org/Tiny-GGUF:Q8_0" in done.stdout
    found = Catalog(CatalogRoots(huggingface=tmp_path)).resolve("org/Tiny-GGUF:Q8_0")
    assert found is not None and found.format == "gguf" and found.source == "huggingface"
    assert found.path.read_bytes() == hub.repos["org/Tiny-GGUF"][1]["Tiny-Q8_0.gguf"]
    fetched = {p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p}
    assert all("Q8_0" in p for p in fetched)  # only the file asked for
    again = _pull(hub, tmp_path, "org/Tiny-GGUF:Q8_0")  # already there: nothing downloaded again
    assert again.returncode == 0 and {p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p} == fetched


def test_a_safetensors_repository(hub, tmp_path):
    done = _pull(hub, tmp_path, "hf.co/org/tiny-st")
    assert done.returncode == 0, done.stderr
    found = Catalog(CatalogRoots(huggingface=tmp_path)).resolve("org/tiny-st")
    assert found is not None and found.format == "hf" and (found.path / "config.json").is_file()


def test_a_killed_transfer_resumes_where_it_stopped(hub, tmp_path):
    hub.delay_s = 0.01  # ~6 MB/s
    proc = _pull(hub, tmp_path, "org/Tiny-GGUF:Q6_K", wait=False)
    try:
        blobs = tmp_path / "models--org--Tiny-GGUF" / "blobs"
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size > (2 << 20) for p in blobs.glob("*.moed-partial") if p.exists()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.kill()
        proc.wait(10)
    finally:
        hub.delay_s = 0.0
    partial = max(p.stat().st_size for p in blobs.glob("*.moed-partial"))
    done = _pull(hub, tmp_path, "org/Tiny-GGUF:Q6_K")
    assert done.returncode == 0, done.stderr
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("Big-Q6_K.gguf") and r]
    assert ranges and int(ranges[-1][6:].split("-")[0]) == partial, (ranges, partial)  # continued, not restarted
    assert not list(blobs.glob("*.moed-partial"))
    found = Catalog(CatalogRoots(huggingface=tmp_path)).resolve("org/Tiny-GGUF:Q6_K")
    expected = hub.repos["org/Tiny-GGUF"][1]["Big-Q6_K.gguf"]
    assert hashlib.sha256(found.path.read_bytes()).hexdigest() == hashlib.sha256(expected).hexdigest()


def test_a_file_that_fails_its_checksum_is_deleted_and_the_pull_fails(hub, tmp_path):
    hub.corrupt.add("Tiny-Q4_K_M.gguf")
    try:
        done = _pull(hub, tmp_path, "org/Tiny-GGUF:Q4_K_M")
    finally:
        hub.corrupt.clear()
    assert done.returncode == 2 and "checksum" in done.stderr and "pull again" in done.stderr, done.stderr
    assert Catalog(CatalogRoots(huggingface=tmp_path)).resolve("org/Tiny-GGUF:Q4_K_M") is None
    assert _pull(hub, tmp_path, "org/Tiny-GGUF:Q4_K_M").returncode == 0  # fetched again, whole


def test_clear_errors(hub, tmp_path):
    missing = _pull(hub, tmp_path, "org/Tiny-GGUF:Q2_K")
    assert missing.returncode == 2 and "no GGUF tagged Q2_K" in missing.stderr and "Q8_0" in missing.stderr
    nothing = _pull(hub, tmp_path, "org/nope")
    assert nothing.returncode == 2 and "no repository org/nope" in nothing.stderr, nothing.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    offline = subprocess.run([sys.executable, "-m", "moed.cli.main", "pull", "org/Tiny-GGUF"], capture_output=True,
                             text=True, timeout=120, env=dict(env, HF_ENDPOINT="http://127.0.0.1:9",
                                                              HF_HUB_CACHE=str(tmp_path)))
    assert offline.returncode == 2 and "cannot reach the Hugging Face Hub" in offline.stderr, offline.stderr


@pytest.mark.parametrize("name", ["org", "../x/y", "org/repo:bad tag", "a/b/c", ""])
def test_bad_names(name):
    with pytest.raises(InvalidRequestError):
        parse_name(name)


def test_ollamas_pull_endpoint_streams_progress_and_the_model_then_answers(hub, tmp_path, monkeypatch):
    import ollama
    from huggingface_hub import constants

    from helpers.http_daemon import start_http_daemon
    from moed.engine.model_manager import LoadOptions
    from moed.engine.model_pool import PoolConfig

    # what HF_ENDPOINT / HF_HUB_CACHE make of these when huggingface_hub is imported (this process imported it already)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    d = start_http_daemon(catalog=Catalog(CatalogRoots(huggingface=tmp_path)), pool=PoolConfig(),
                          options=LoadOptions(device="cpu", context_length=128))
    try:
        client = d.ollama()
        parts = list(client.pull("hf.co/org/Tiny-GGUF:Q8_0", stream=True))
        statuses = [p.status for p in parts]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
        sizes = [p for p in parts if p.total]
        assert sizes and sizes[-1].completed == sizes[-1].total and sizes[-1].digest.startswith("sha256:")
        assert "org/Tiny-GGUF:Q8_0" in {m.model for m in client.list().models}
        answer = client.generate(model="org/Tiny-GGUF:Q8_0", prompt="The router", options={"num_predict": 3})
        assert answer.done and answer.eval_count == 3 or answer.done_reason == "stop"
        with pytest.raises(ollama.ResponseError) as info:
            client.pull("qwen3:30b")
        assert info.value.status_code == 400 and "Hugging Face Hub" in info.value.error
        assert client.pull("hf.co/org/Tiny-GGUF:Q8_0", stream=False).status == "success"
    finally:
        d.close()


def test_moed_run_pulls_a_hub_model_that_is_not_here_then_answers(hub, tmp_path):
    """As `ollama run` does: the daemon finds no `org/repo:QUANT`, the CLI pulls it into the Hugging Face cache the
    daemon reads, and asks again; --no-pull leaves the error as it is."""
    from helpers.daemon_process import start_daemon

    daemon = start_daemon(tmp_path / "home", "--device", "cpu", extra_env={"HF_ENDPOINT": hub.url})
    try:
        env = {k: v for k, v in daemon.env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env.update(MOED_SOCKET=str(daemon.socket), HF_ENDPOINT=hub.url)

        def moed(*args):
            return subprocess.run([sys.executable, "-m", "moed.cli.main", *args], env=env, capture_output=True,
                                  text=True, timeout=180)

        refused = moed("run", "org/Tiny-GGUF:Q8_0", "The router reads", "--no-pull")
        assert refused.returncode == 2 and "not found" in refused.stderr
        done = moed("run", "org/Tiny-GGUF:Q8_0", "The router reads", "--max-tokens", "3", "--temperature", "0")
        assert done.returncode == 0, done.stderr
        assert "pulling it from the Hugging Face Hub" in done.stderr and "generated" in done.stderr
        typo = moed("run", "nothing-like-this", "hi")  # not a Hub name: no pull, the daemon's error
        assert typo.returncode == 2 and "pulling" not in typo.stderr
    finally:
        assert daemon.stop() == 0
