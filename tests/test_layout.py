"""Repository layout rules: the package map is complete, layers do not import upwards, no import cycles."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "daemon"

# layer -> packages it must not import: no upward imports (docs/architecture.md). Every import
# statement counts, wherever it is (module level, inside functions, under TYPE_CHECKING).
FORBIDDEN = {
    "kernels": {"models", "layers", "experts", "cache", "engine", "runner", "weights", "cli", "text", "devices"},
    "cache": {"engine", "cli", "models", "layers", "runner", "weights"},
    "text": {"models", "layers", "experts", "cache", "engine", "runner", "weights", "cli", "kernels"},
    "layers": {"engine", "cli", "weights", "models"},
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
    "catalog": {"models", "layers", "experts", "cache", "engine", "runner", "cli", "text", "kernels", "api", "devices"},
    "v1": {"models", "layers", "experts", "cache", "engine", "runner", "weights", "cli", "text", "kernels",
           "api", "service", "devices"},
}


def module_name(path: Path) -> str:
    """``daemon/experts/policies.py`` -> ``moed.experts.policies``; a package's __init__ -> the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("moed",) + parts)


def module_import_graph() -> dict[str, set[str]]:
    """Module -> the ``moed`` modules it imports, from every import statement anywhere in the file.

    Strict on purpose: imports inside functions and under ``TYPE_CHECKING`` count too, since a
    lazy import that only hides a cycle is still a cycle in the design. ``import moed.a.b`` and
    ``from moed.a import b`` point at the module ``moed.a.b`` (``b`` a module) or else at
    ``moed.a``; relative imports are resolved. The parent packages Python initialises on the way
    are not edges (they would make every ``__init__`` that imports its own submodules a cycle).
    """
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    if not is_package:
                        anchor = anchor[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in files else base)
            for target in targets:
                # `import moed.a.b.c` where c is not a module file: walk up to the nearest module
                while target and target not in files and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in files and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def test_no_upward_imports():
    problems = []
    for module, targets in sorted(module_import_graph().items()):
        parts = module.split(".")
        forbidden = FORBIDDEN.get(parts[1], set()) if len(parts) > 1 else set()
        bad = {t.split(".")[1] for t in targets if len(t.split(".")) > 1} & forbidden
        if bad:
            problems.append(f"{module} imports {sorted(bad)}")
    assert not problems, "\n".join(problems)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle (a -> ... -> a) per strongly connected component larger than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is a few hundred modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)

    cycles = []
    for component in components:
        start = min(component)
        # breadth-first search for the shortest way back to start inside the component
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        found = paths[v] + [start]
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        cycles.append(found)
    return cycles


def test_import_graph_helpers_see_cycles():
    graph = {"moed.a": {"moed.b"}, "moed.b": {"moed.c"}, "moed.c": {"moed.a"}, "moed.d": {"moed.a"}}
    assert import_cycles(graph) == [["moed.a", "moed.b", "moed.c", "moed.a"]]
    assert import_cycles({"moed.a": {"moed.b"}, "moed.b": set()}) == []
    graph = module_import_graph()
    assert "moed.experts.policies" in graph["moed.experts.executor_factory"]
    assert "moed.devices.device" in graph["moed.devices.cpu"]  # relative import resolved


def test_no_import_cycles():
    cycles = import_cycles(module_import_graph())
    assert not cycles, "import cycles between moed modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_between_subpackages():
    """The same graph folded to sub-packages (``moed.layers``, ``moed.models``, ...; top-level modules
    such as ``moed.config`` stay themselves): two packages importing each other is a cycle even when
    no single pair of modules is."""
    packages: dict[str, set[str]] = {}
    for module, targets in module_import_graph().items():
        node = ".".join(module.split(".")[:2])
        packages.setdefault(node, set()).update(".".join(t.split(".")[:2]) for t in targets)
    for node, targets in packages.items():
        targets.discard(node)
    cycles = import_cycles(packages)
    assert not cycles, "import cycles between moed packages:\n" + "\n".join(" -> ".join(c) for c in cycles)


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
