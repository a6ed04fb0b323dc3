"""Repository layout rules: the package map is complete and layers do not import upwards."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "daemon"

# layer -> packages it must not import (CONVENTIONS.md, habit 4)
FORBIDDEN = {
    "kernels": {"models", "layers", "experts", "cache", "engine", "runner", "weights", "cli", "text", "devices"},
    "cache": {"engine", "cli", "models", "layers", "runner", "weights"},
    "text": {"models", "layers", "experts", "cache", "engine", "runner", "weights", "cli", "kernels"},
    "layers": {"engine", "cli", "weights"},
    "models": {"engine", "cli"},
    "weights": {"engine", "cli"},
    "experts": {"engine", "cli", "models", "layers", "weights"},
    "runner": {"engine", "cli", "weights"},
    "engine": {"cli", "api"},
    "devices": {"models", "layers", "experts", "cache", "engine", "runner", "weights", "cli", "text", "kernels",
                "api", "service"},
    "service": {"models", "layers", "experts", "cache", "engine", "runner", "weights", "cli", "text", "kernels",
                "api", "devices"},
    "api": {"cli", "models", "layers", "runner", "kernels", "weights", "cache", "devices"},
    "v1": {"models", "layers", "experts", "cache", "engine", "runner", "weights", "cli", "text", "kernels",
           "api", "service", "devices"},
}


def imported_moed_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "moed" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_no_upward_imports():
    problems = []
    for layer, forbidden in FORBIDDEN.items():
        for file in (PACKAGE / layer).rglob("*.py"):
            bad = imported_moed_packages(file) & forbidden
            if bad:
                problems.append(f"{file.relative_to(ROOT)} imports {sorted(bad)}")
    assert not problems, "\n".join(problems)


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(re.findall(r'"(moed(?:\.\w+)*)"', (ROOT / "pyproject.toml").read_text()))
    actual = {"moed"} | {
        "moed." + ".".join(p.parent.relative_to(PACKAGE).parts)
        for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE
    }
    assert actual <= listed, f"missing from pyproject packages: {sorted(actual - listed)}"


def test_no_generic_top_level_import_names_installed():
    code = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(n) for n in ('daemon', 'tray')))"
    # run outside the repo so the working directory is not on sys.path
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True)
    assert result.returncode == 0, "a generic top-level name (daemon/tray) is importable from site-packages"
