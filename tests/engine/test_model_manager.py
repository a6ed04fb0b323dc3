"""ModelManager: discovery, loading by name, the host-RAM check before a load, unloading."""

from __future__ import annotations

import pytest

from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.model_manager import LoadOptions, ModelManager
from moed.errors import InsufficientMemoryError, InvalidRequestError
from moed.weights.model_loader import estimate_host_bytes


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    build_tiny_model("olmoe", root / "tiny")
    write_tiny_tokenizer(root / "tiny")
    return root


def test_load_by_name_then_unload(models):
    manager = ModelManager([models])
    assert [p.name for p in manager.discover()] == ["tiny"]
    entry = manager.load("tiny", LoadOptions(device="cpu"))
    try:
        assert manager.get().name == "tiny" and entry.host_bytes() > 0
        with pytest.raises(InvalidRequestError, match="already loaded"):
            manager.load("tiny", LoadOptions(device="cpu"))
    finally:
        assert manager.unload("tiny")
    with pytest.raises(InvalidRequestError, match="no model is loaded"):
        manager.get()


def test_a_model_that_does_not_fit_in_host_ram_is_refused_before_loading(models):
    need = estimate_host_bytes(models / "tiny")
    assert need > 0
    manager = ModelManager([models], host_ram_available=lambda: need // 2)
    with pytest.raises(InsufficientMemoryError, match="host RAM"):
        manager.load("tiny", LoadOptions(device="cpu"))
    assert not manager.loaded() and not manager.is_loading


def test_unknown_model_names_say_where_they_looked(models):
    with pytest.raises(InvalidRequestError, match=str(models)):
        ModelManager([models]).load("nope", LoadOptions())
