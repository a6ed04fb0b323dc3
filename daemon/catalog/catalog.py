"""Catalog: every model on this machine by name, from moed's own folders, Ollama's store, the Hugging Face cache
and LM Studio's folder, in that order of precedence; files are read where they are, never copied.

A name resolves to the first source that has it: a path; a model in moed's folders; an Ollama name
(``qwen3:30b-a3b``, ``library/qwen3``, ``hf.co/org/repo:Q4_K_M``; no tag = ``latest``); a Hugging Face repository
in the cache (``org/repo`` for safetensors, ``org/repo:TAG`` for one of its GGUF files, no tag = ``Q4_K_M`` or the
only GGUF, as llama.cpp's ``-hf``); the same in LM Studio's folder. Names compare case-insensitively.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from moed.catalog import hf_cache, lmstudio, ollama_store, own_models
from moed.catalog.entry import CatalogEntry, disk_bytes, format_of
from moed.catalog.gguf_tags import pick_file


@dataclass(frozen=True)
class CatalogRoots:
    """Where each source lives (None / empty: that source is off)."""

    moed: tuple[Path, ...] = ()
    ollama: tuple[Path, ...] = ()
    huggingface: Path | None = None
    lmstudio: tuple[Path, ...] = ()

    @classmethod
    def default(cls, moed_dirs: Sequence[Path]) -> "CatalogRoots":
        """This user's folders ($OLLAMA_MODELS, $HF_HUB_CACHE / $HF_HOME, $LMSTUDIO_MODELS are respected)."""
        return cls(tuple(moed_dirs), tuple(ollama_store.default_roots()), hf_cache.default_root(),
                   tuple(lmstudio.default_roots()))


@dataclass
class Catalog:
    roots: CatalogRoots = field(default_factory=CatalogRoots)

    def own(self) -> list[CatalogEntry]:
        """moed's own folders, first of each name."""
        return _first_of_each([e for root in self.roots.moed for e in own_models.scan(root)])

    def ollama(self) -> list[CatalogEntry]:
        return _first_of_each([e for root in self.roots.ollama for e in ollama_store.scan(root)])

    def huggingface(self) -> list[CatalogEntry]:
        return hf_cache.scan(self.roots.huggingface) if self.roots.huggingface is not None else []

    def lmstudio(self) -> list[CatalogEntry]:
        return _first_of_each([e for root in self.roots.lmstudio for e in lmstudio.scan(root)])

    def list(self) -> list[CatalogEntry]:
        """Every model, first of each name in the order of precedence."""
        return _first_of_each(self.own() + self.ollama() + self.huggingface() + self.lmstudio())

    def resolve(self, name: str) -> CatalogEntry | None:
        """The model ``name`` (a path or a name) is, or None."""
        path = Path(name).expanduser()
        try:
            if path.is_dir() or path.is_file():
                path = path.resolve()
                return CatalogEntry(own_models.model_name_of(path), path, "path", format_of(path), disk_bytes(path))
        except OSError:  # a name too long for the filesystem, a loop of symlinks, no permission
            pass
        for entry in self.own():
            if entry.name == name:
                return entry
        wanted = name.lower()
        target = ollama_store.normalise(name)
        for entry in self.ollama():
            if entry.name.lower() == target:
                return entry
        for entries in (self.huggingface(), self.lmstudio()):
            found = _by_repo_name(entries, wanted)
            if found is not None:
                return found
        return None


def _by_repo_name(entries: list[CatalogEntry], wanted: str) -> CatalogEntry | None:
    """``org/repo`` or ``org/repo:TAG`` among one source's entries."""
    for entry in entries:
        if entry.name.lower() == wanted:
            return entry
    repo, sep, tag = wanted.partition(":")
    ggufs = {e.name.lower(): e for e in entries if e.format == "gguf" and e.name.lower().startswith(repo + ":")}
    if not ggufs:
        return None
    by_file = {e.path.name: e for e in ggufs.values()}
    chosen = pick_file(by_file, tag if sep else None)
    return by_file[chosen] if chosen is not None else None


def _first_of_each(entries: list[CatalogEntry]) -> list[CatalogEntry]:
    seen: set[str] = set()
    out = []
    for entry in entries:
        if entry.name.lower() not in seen:
            seen.add(entry.name.lower())
            out.append(entry)
    return out
