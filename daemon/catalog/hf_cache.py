"""The Hugging Face cache, read in place through ``huggingface_hub.scan_cache_dir``: a snapshot with a
config.json is a model directory (``org/repo``), each GGUF of a snapshot a model named ``org/repo:TAG`` (the
quantisation tag of its file name, as llama.cpp's ``-hf`` names them)."""

from __future__ import annotations

import logging
from pathlib import Path

from moed.catalog.entry import CatalogEntry, disk_bytes
from moed.catalog.gguf_tags import is_first_part, quant_tag

log = logging.getLogger("moed.catalog")


def default_root() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def scan(root: Path | None = None) -> list[CatalogEntry]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(root)
    except CacheNotFound:
        return []
    except OSError as exc:
        log.warning("cannot read the Hugging Face cache %s: %s", root, exc)
        return []
    entries = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: r.last_modified)  # the newest snapshot
        snapshot = Path(revision.snapshot_path)
        names = {f.file_name: Path(f.file_path) for f in revision.files}
        if "config.json" in names and any(n.endswith(".safetensors") for n in names):
            entries.append(CatalogEntry(name=repo.repo_id, path=snapshot, source="huggingface", format="hf",
                                        size=revision.size_on_disk, modified=revision.last_modified))
        for file in sorted((f for f in revision.files if is_first_part(f.file_name)), key=lambda f: f.file_name):
            tag = quant_tag(file.file_name) or file.file_name[:-5]
            path = Path(file.file_path)
            entries.append(CatalogEntry(name=f"{repo.repo_id}:{tag}", path=path, source="huggingface", format="gguf",
                                        size=disk_bytes(path), modified=revision.last_modified))
    return entries
