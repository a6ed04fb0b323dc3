"""moed's own model folders ($MOED_MODELS, ~/.local/share/moed/models, ./models): each model directory (FTW or
Hugging Face) or GGUF file in them is a model named after it."""

from __future__ import annotations

from pathlib import Path

from moed.catalog.entry import CatalogEntry, disk_bytes, format_of


def is_model_dir(path: Path) -> bool:
    return (path / "ftw.json").is_file() or (path / "config.json").is_file()


def is_model_path(path: Path) -> bool:
    """A model directory (FTW or Hugging Face) or a GGUF file."""
    from moed.weights.gguf_file import is_gguf_file

    try:
        return is_model_dir(path) if path.is_dir() else is_gguf_file(path)
    except OSError:
        return False


def model_name_of(path: Path) -> str:
    """The name a model is listed under: its directory's name, or a GGUF file's name without .gguf."""
    return path.name[:-5] if path.suffix.lower() == ".gguf" and not path.is_dir() else path.name


def scan(root: Path) -> list[CatalogEntry]:
    """The models in ``root`` (and ``root`` itself when it is one), first of each name."""
    try:
        if not root.is_dir():
            return []
        candidates = [root] + sorted(p for p in root.iterdir() if p.is_dir() or p.suffix.lower() == ".gguf")
    except OSError:
        return []
    entries = []
    for path in candidates:
        if is_model_path(path):
            try:
                modified = path.stat().st_mtime
            except OSError:
                continue
            entries.append(CatalogEntry(name=model_name_of(path), path=path, source="moed", format=format_of(path),
                                        size=disk_bytes(path), modified=modified))
    return entries
