"""LM Studio's model folder, read in place: ``PUBLISHER/REPO/FILE.gguf`` (a copy of a Hugging Face GGUF
repository's files), each GGUF a model named ``PUBLISHER/REPO:TAG`` as in the Hugging Face cache."""

from __future__ import annotations

import os
from pathlib import Path

from moed.catalog.entry import CatalogEntry, disk_bytes
from moed.catalog.gguf_tags import is_first_part, quant_tag


def default_roots() -> list[Path]:
    """$LMSTUDIO_MODELS, else ~/.lmstudio/models (LM Studio 0.3+) and ~/.cache/lm-studio/models (older)."""
    if os.environ.get("LMSTUDIO_MODELS"):
        return [Path(os.environ["LMSTUDIO_MODELS"]).expanduser()]
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def scan(root: Path) -> list[CatalogEntry]:
    entries = []
    try:
        publishers = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return []
    for publisher in publishers:
        for repo in sorted(p for p in publisher.iterdir() if p.is_dir()):
            try:
                files = sorted(p for p in repo.iterdir() if p.is_file() and is_first_part(p.name))
            except OSError:
                continue
            for path in files:
                tag = quant_tag(path.name) or path.name[:-5]
                entries.append(CatalogEntry(name=f"{publisher.name}/{repo.name}:{tag}", path=path, source="lmstudio",
                                            format="gguf", size=disk_bytes(path), modified=path.stat().st_mtime))
    return entries
