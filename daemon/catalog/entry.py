"""CatalogEntry: one model the catalog knows, by the name a user gives it, and where its files are."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOURCES = ("moed", "ollama", "huggingface", "lmstudio", "path")


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # what requests, `moed load` and the tray call it: "qwen3:30b-a3b", "org/repo:Q4_K_M", "my-model"
    path: Path  # a GGUF file (the first part of a split one) or a model directory, read in place
    source: str  # one of SOURCES
    format: str  # "gguf", "hf" or "ftw"
    size: int = 0  # bytes on disk (every part of a split GGUF)
    modified: float = 0.0  # seconds since the epoch
    digest: str = ""  # Ollama's blob digest ("sha256:..."), else ""
    # Ollama's manifest layers: the default parameters (stop, temperature, num_ctx ...), system message and
    # the (Go) template text, shown by /api/show; the model's own Jinja template renders prompts
    params: dict[str, Any] = field(default_factory=dict, compare=False)
    system: str = ""
    template: str = ""


def format_of(path: Path) -> str:
    if path.is_dir():
        return "ftw" if (path / "ftw.json").is_file() else "hf"
    return "gguf"


def disk_bytes(path: Path) -> int:
    """Bytes on disk of a GGUF (all its split parts) or a model directory's files."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        parts = split_parts(path)
        return sum(p.stat().st_size for p in parts)
    except OSError:
        return 0


def split_parts(path: Path) -> list[Path]:
    """A GGUF's files: ``x-00001-of-00003.gguf`` -> its three parts (those present); any other file -> itself."""
    from moed.catalog.gguf_tags import SPLIT

    match = SPLIT.search(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    return [p for i in range(count)
            if (p := path.with_name(f"{path.name[:match.start()]}-{i + 1:05d}-of-{match['count']}.gguf")).exists()]
