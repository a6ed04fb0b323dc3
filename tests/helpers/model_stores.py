"""Other programs' model stores laid out exactly as they write them, for tests of moed.catalog:

* Ollama (``ollama pull``): ``manifests/HOST/NAMESPACE/MODEL/TAG`` (a docker v2 manifest whose layers are
  ``application/vnd.ollama.image.model`` + template / params / system / license) and ``blobs/sha256-HEX``;
* the Hugging Face cache (huggingface_hub): ``models--ORG--REPO/{blobs/ETAG, snapshots/COMMIT/FILE -> blob,
  refs/main}``;
* LM Studio: ``PUBLISHER/REPO/FILE.gguf``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path


def _blob(root: Path, data_path: Path | None = None, text: str | None = None, *, move: bool = False) -> tuple[str, int]:
    """Store a file (moved or copied) or a text as a blob; returns (digest, size)."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    if text is not None:
        data = text.encode()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(data)
        return f"sha256:{digest}", len(data)
    digest = hashlib.sha256(data_path.read_bytes()).hexdigest()
    target = blobs / f"sha256-{digest}"
    if not target.exists():
        (shutil.move if move else shutil.copyfile)(data_path, target)
    return f"sha256:{digest}", target.stat().st_size


def add_ollama_model(root: Path, gguf: Path, name: str, *, params: dict | None = None, template: str = "",
                     system: str = "", host: str = "registry.ollama.ai", move: bool = False) -> Path:
    """``name`` as Ollama's short form ("tiny:latest", "user/tiny:q8", "hf.co/org/repo:Q8_0"); returns the blob."""
    base, _, tag = name.rpartition(":")
    parts = base.split("/")
    if len(parts) == 1:
        parts = [host, "library", parts[0]]
    elif len(parts) == 2:
        parts = [host, *parts]
    digest, size = _blob(root, gguf, move=move)
    layers = [{"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": size}]
    for media, text in (("template", template), ("system", system), ("license", "MIT"),
                        ("params", json.dumps(params) if params else "")):
        if text:
            d, n = _blob(root, text=text)
            layers.append({"mediaType": f"application/vnd.ollama.image.{media}", "digest": d, "size": n})
    config_digest, config_size = _blob(root, text=json.dumps({"model_format": "gguf", "model_family": "qwen3moe"}))
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": config_digest,
                           "size": config_size}, "layers": layers}
    path = root / "manifests" / parts[0] / parts[1] / parts[2] / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return root / "blobs" / f"sha256-{digest.split(':')[1]}"


def add_hf_cache_repo(cache: Path, repo_id: str, files: dict[str, Path], *, commit: str = "a" * 40) -> Path:
    """A model repository in huggingface_hub's cache layout with ``files`` (repo path -> local file, copied into
    the blobs); returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        data = source.read_bytes()
        etag = hashlib.sha256(data).hexdigest()
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def add_lmstudio_model(root: Path, publisher: str, repo: str, gguf: Path, file_name: str) -> Path:
    target = root / publisher / repo / file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(gguf, target)
    return target
