"""Ollama's model endpoints over moed's catalog and loaded models: ``/api/tags`` (every model on disk),
``/api/ps`` (loaded ones, with the time they unload), ``/api/show``, ``/api/delete`` (only models in moed's own
folders: other programs' files are theirs), ``/api/version``. Answers are ``ollama._types`` objects."""

from __future__ import annotations

import hashlib
import logging
import shutil
from datetime import datetime, timedelta, timezone
from typing import Any

from ollama._types import ListResponse, ModelDetails, ProcessResponse, ShowResponse

from moed.api.daemon_context import DaemonContext
from moed.api.http.error_status import ParamError
from moed.catalog.entry import CatalogEntry
from moed.catalog.gguf_tags import quant_tag
from moed.engine.model_manager import LoadedEntry
from moed.errors import ModelNotFoundError, quoted

log = logging.getLogger("moed.api.http")

# the Ollama API version moed's endpoints follow (clients compare it with the features they need)
OLLAMA_API_VERSION = "0.13.0"
FOREVER = datetime(2318, 1, 1, tzinfo=timezone.utc)  # what Ollama reports for keep_alive -1


def _digest(found: CatalogEntry) -> str:
    """Ollama's digest for its own models; a stable id of the path for the others."""
    if found.digest:
        return found.digest.removeprefix("sha256:")
    return hashlib.sha256(str(found.path).encode()).hexdigest()


def details(found: CatalogEntry | None, entry: LoadedEntry | None = None) -> ModelDetails:
    family = entry.runtime.model.config.family if entry is not None else ""
    quant = quant_tag(found.path.name) if found is not None and found.format == "gguf" else ""
    if entry is not None and not quant and entry.runtime.loaded is not None:
        quant = entry.runtime.loaded.bank.dtype
    return ModelDetails(format=found.format if found is not None else "", family=family,
                        families=[family] if family else None, parameter_size="",
                        quantization_level=quant, parent_model="")


def tags(ctx: DaemonContext) -> dict[str, Any]:
    models = [ListResponse.Model(model=f.name, modified_at=datetime.fromtimestamp(f.modified, timezone.utc),
                                 digest=_digest(f), size=f.size, details=details(f))
              for f in ctx.manager.catalog.list()]
    out = ListResponse(models=models).model_dump(mode="json", exclude_none=True)
    for m, f in zip(out["models"], ctx.manager.catalog.list()):
        m["name"] = f.name  # Ollama sends both; older clients read "name"
    return out


def ps(ctx: DaemonContext) -> dict[str, Any]:
    now = datetime.now(timezone.utc)
    models = []
    for entry in ctx.manager.loaded():
        left = ctx.pool.expires_in(entry.name) if ctx.pool is not None else None
        found = entry.found
        models.append(ProcessResponse.Model(
            model=entry.name, name=entry.name, digest=_digest(found) if found is not None else "",
            expires_at=FOREVER if left is None else now + timedelta(seconds=left),
            size=entry.host_bytes() + entry.vram_bytes(), size_vram=entry.vram_bytes(), details=details(found, entry),
            context_length=entry.loop.context_length))
    return ProcessResponse(models=models).model_dump(mode="json", exclude_none=True)


def _find(ctx: DaemonContext, name: Any) -> CatalogEntry:
    if not isinstance(name, str) or not name:
        raise ParamError("model is required: give a model's name (GET /api/tags lists them)", "model")
    found = ctx.manager.catalog.resolve(name)
    if found is None:
        raise ModelNotFoundError(f"model {quoted(name)} not found; GET /api/tags lists the models on this machine")
    return found


def show(ctx: DaemonContext, data: dict[str, Any]) -> dict[str, Any]:
    name = data.get("model") or data.get("name")
    found = _find(ctx, name)
    entry = next((e for e in ctx.manager.loaded() if e.path == found.path), None)
    params = "\n".join(f"{k} {v}" for k, values in found.params.items()
                       for v in (values if isinstance(values, list) else [values]))
    info: dict[str, Any] = {"general.file_type": found.format, "moed.source": found.source,
                            "moed.path": str(found.path)}
    capabilities = ["completion"]
    template = found.template
    if entry is not None:
        tokenizer = entry.runtime.tokenizer
        info.update({"general.architecture": entry.runtime.model.config.family,
                     "moed.context_length": entry.loop.context_length})
        template = template or (tokenizer.chat_template or "")
        if "tools" in (tokenizer.tool_chat_template or ""):
            capabilities.append("tools")
        if "<think>" in (tokenizer.chat_template or "") or "enable_thinking" in (tokenizer.chat_template or ""):
            capabilities.append("thinking")
    modelfile = "\n".join([f"# moed: {found.source} model {found.name}", f"FROM {found.path}",
                           *(f"PARAMETER {line}" for line in params.splitlines()),
                           *([f'SYSTEM """{found.system}"""'] if found.system else [])])
    answer = ShowResponse(modified_at=datetime.fromtimestamp(found.modified, timezone.utc), template=template,
                          modelfile=modelfile, license="", details=details(found, entry), model_info=info,
                          parameters=params, capabilities=capabilities)
    return answer.model_dump(mode="json", exclude_none=True, by_alias=True)


def delete(ctx: DaemonContext, data: dict[str, Any]) -> None:
    """Remove a model from moed's own folders (unloaded first); other programs' models are refused."""
    found = _find(ctx, data.get("model") or data.get("name"))
    if found.source != "moed":
        owner = {"ollama": "`ollama rm`", "huggingface": "`hf cache delete`", "lmstudio": "LM Studio",
                 "path": "your file manager"}.get(found.source, "the program that made it")
        raise ParamError(f"model {quoted(found.name)} is in {found.source}'s files, which moed only reads; remove it "
                         f"with {owner}", "model")
    for entry in ctx.manager.loaded():
        if entry.path == found.path:
            ctx.manager.unload(entry.name)
    log.info("deleting model %s (%s)", found.name, found.path)
    if found.path.is_dir():
        shutil.rmtree(found.path)
    else:
        found.path.unlink()
