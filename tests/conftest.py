import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[0]))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The demo model's Hugging Face directory, built once per session (helpers.demo_model)."""
    from helpers.demo_model import build_demo

    return build_demo(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def demo_models_dir(demo_model, tmp_path_factory):
    """A models directory holding the demo model as `make demo` converts it (q8 experts): demo-moe-ftw."""
    from moed.weights.converter import convert_model

    models = tmp_path_factory.mktemp("demo-models")
    convert_model(demo_model.hf_dir, models / "demo-moe-ftw", experts_dtype="q8")
    return models
