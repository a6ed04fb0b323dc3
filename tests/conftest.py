import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[0]))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """The demo model's Hugging Face directory, built once per session (helpers.demo_model)."""
    from helpers.demo_model import build_demo

    return build_demo(tmp_path_factory.mktemp("demo-model"))
