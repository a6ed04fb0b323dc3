"""Ollama's model store, read in place: ``manifests/HOST/NAMESPACE/MODEL/TAG`` (JSON) whose model layer names a
GGUF blob in ``blobs/sha256-HEX``, beside the template, system and params layers.

Names are Ollama's short forms: ``qwen3:30b-a3b`` (registry.ollama.ai/library), ``user/model:tag`` (another
namespace of that registry), ``hf.co/org/repo:Q4_K_M`` (another host); no tag means ``latest``. Requested names are
only ever matched against the manifests found (never joined into a path). Nothing here writes to the store.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from moed.catalog.entry import CatalogEntry

log = logging.getLogger("moed.catalog")

DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
PARAMS_LAYER = "application/vnd.ollama.image.params"
SYSTEM_LAYER = "application/vnd.ollama.image.system"
TEMPLATE_LAYER = "application/vnd.ollama.image.template"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few hundred bytes; a text layer a few KiB
MAX_TEXT_LAYER_BYTES = 1 << 20


def default_roots() -> list[Path]:
    """$OLLAMA_MODELS, else the user's store (~/.ollama/models) and the Linux service's (/usr/share/ollama/...)."""
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def short_name(host: str, namespace: str, model: str, tag: str) -> str:
    """Ollama's display name of a manifest path."""
    if host == DEFAULT_HOST:
        prefix = "" if namespace == DEFAULT_NAMESPACE else f"{namespace}/"
    else:
        prefix = f"{host}/{namespace}/"
    return f"{prefix}{model}:{tag}"


def normalise(name: str) -> str:
    """A requested name in the short form (lower case, ``:latest`` added), comparable with ``short_name``."""
    base, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:
        base, tag = name, DEFAULT_TAG
    parts = base.split("/")
    if len(parts) == 3 and parts[0] == DEFAULT_HOST:
        parts = parts[1:]
    if len(parts) == 2 and parts[0] == DEFAULT_NAMESPACE:
        parts = parts[1:]
    return f"{'/'.join(parts)}:{tag}".lower()


def _read_json(path: Path, limit: int) -> Any:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return json.loads(data)


def _blob(root: Path, digest: str) -> Path | None:
    algo, _, hexdigest = str(digest).partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        return None
    path = root / "blobs" / f"sha256-{hexdigest}"
    return path if path.is_file() else None


def _text_layer(root: Path, layer: dict | None) -> str:
    if not layer:
        return ""
    path = _blob(root, layer.get("digest", ""))
    if path is None:
        return ""
    with open(path, "rb") as f:
        return f.read(MAX_TEXT_LAYER_BYTES).decode("utf-8", errors="replace")


def read_manifest(root: Path, manifest: Path, host: str, namespace: str, model: str, tag: str) -> CatalogEntry | None:
    """The entry of one manifest, or None (logged) when it is unreadable or has no GGUF model layer."""
    try:
        doc = _read_json(manifest, MAX_MANIFEST_BYTES)
        layers = {layer.get("mediaType"): layer for layer in doc.get("layers", []) if isinstance(layer, dict)}
        model_layer = layers.get(MODEL_LAYER)
        blob = _blob(root, model_layer.get("digest", "")) if model_layer else None
        if blob is None:
            log.debug("ollama manifest %s: no model blob", manifest)
            return None
        params: dict[str, Any] = {}
        if layers.get(PARAMS_LAYER):
            text = _text_layer(root, layers[PARAMS_LAYER])
            value = json.loads(text) if text.strip() else {}
            params = value if isinstance(value, dict) else {}
        return CatalogEntry(name=short_name(host, namespace, model, tag), path=blob, source="ollama", format="gguf",
                            size=blob.stat().st_size, modified=manifest.stat().st_mtime,
                            digest=model_layer["digest"], params=params,
                            system=_text_layer(root, layers.get(SYSTEM_LAYER)),
                            template=_text_layer(root, layers.get(TEMPLATE_LAYER)))
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        log.warning("skipping Ollama manifest %s: %s", manifest, exc)
        return None


def scan(root: Path) -> list[CatalogEntry]:
    """Every model of the store at ``root`` (an absent store is empty)."""
    manifests = root / "manifests"
    entries = []
    try:
        hosts = sorted(p for p in manifests.iterdir() if p.is_dir())
    except OSError:
        return []
    for host in hosts:
        for namespace in sorted(p for p in host.iterdir() if p.is_dir()):
            for model in sorted(p for p in namespace.iterdir() if p.is_dir()):
                for tag in sorted(p for p in model.iterdir() if p.is_file()):
                    entry = read_manifest(root, tag, host.name, namespace.name, model.name, tag.name)
                    if entry is not None:
                        entries.append(entry)
    return entries
