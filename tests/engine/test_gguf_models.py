"""GGUF files are models like directories for the daemon's model manager: found in the model
directories by name (file name without .gguf), loaded by path, listed, refused clearly when bad."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import write_tiny_gguf
from moed.engine.model_manager import LoadOptions, ModelManager, dir_bytes
from moed.engine.sampling import SamplingParams
from moed.errors import ModelFormatError


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path_factory.mktemp("build"), expert_type=T.Q8_0,
                                 weight_type=T.Q8_0)
    (root / "Tiny-Qwen3-Q8_0.gguf").write_bytes(path.read_bytes())
    (root / "broken.gguf").write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    (root / "notes.gguf").write_text("not a model")
    return root


def test_a_gguf_file_is_discovered_by_name_and_loads(models):
    manager = ModelManager([models])
    names = sorted(p.name for p in manager.discover())
    assert names == ["Tiny-Qwen3-Q8_0.gguf", "broken.gguf"]  # magic checked; the text file is no model
    entry = manager.load("Tiny-Qwen3-Q8_0", LoadOptions(device="cpu"))
    try:
        assert entry.name == "Tiny-Qwen3-Q8_0" and entry.runtime.loaded.format == "gguf"
        assert entry.runtime.loaded.bank.dtype == "q8"
        assert dir_bytes(entry.path) == (models / "Tiny-Qwen3-Q8_0.gguf").stat().st_size
        ids = entry.runtime.encode_prompt("hello there", chat=True)
        assert ids and entry.runtime.tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\n")
        from moed.engine.offline_run import run_offline

        (done,) = run_offline(entry.runtime, [ids], [SamplingParams(max_tokens=4, ignore_eos=True)], context_length=64)
        assert len(done.token_ids) == 4
    finally:
        manager.unload_all()


def test_a_gguf_loads_by_path_under_its_file_name(models):
    manager = ModelManager([])
    entry = manager.load(str(models / "Tiny-Qwen3-Q8_0.gguf"), LoadOptions(device="cpu"))
    try:
        assert entry.name == "Tiny-Qwen3-Q8_0"
    finally:
        manager.unload_all()


def test_a_truncated_gguf_is_refused_before_loading_and_the_manager_stays_usable(models):
    manager = ModelManager([models])
    with pytest.raises(ModelFormatError, match=r"broken\.gguf is truncated: tensor .* download it again") as info:
        manager.load("broken", LoadOptions(device="cpu"))
    assert "\n" not in str(info.value) and manager.loaded() == [] and not manager.is_loading
    with pytest.raises(ModelFormatError, match="not a model directory and not a GGUF file"):
        manager.load(str(models / "notes.gguf"), LoadOptions(device="cpu"))
    entry = manager.load("Tiny-Qwen3-Q8_0", LoadOptions(device="cpu"))
    manager.unload(entry.name)
