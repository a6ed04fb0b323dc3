"""Ollama's API on moed's HTTP port (``/api/*``), so Ollama's apps and libraries (Open WebUI, Continue, Zed, the
``ollama`` Python and JS clients) use moed as they use Ollama: ``/api/chat``, ``/api/generate`` (NDJSON streams),
``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/pull``, ``/api/delete``, ``/api/version``, and ``GET /``. A request
naming a model that is not loaded loads it (the daemon's model pool). Errors are Ollama's ``{"error": "..."}``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from moed.api.daemon_context import DaemonContext
from moed.api.http.bridge import EngineBridge
from moed.api.http.error_status import HttpFailure
from moed.api.http.ollama_chat import json_object, ollama_chat, ollama_generate
from moed.api.http.ollama_models import OLLAMA_API_VERSION, delete, ps, show, tags
from moed.api.http.ollama_pull import ollama_pull

ERROR_PATH_PREFIX = "/api/"
NOT_OFFERED = {
    "/api/embed": "moed runs generative models only; it computes no embeddings",
    "/api/embeddings": "moed runs generative models only; it computes no embeddings",
    "/api/create": "moed makes models with `moed convert`; it does not build them from Modelfiles",
    "/api/copy": "moed reads models where they are; name them as they are listed (GET /api/tags)",
    "/api/push": "moed does not upload models",
}


def ollama_error_response(failure: HttpFailure) -> Response:
    headers = {"Retry-After": str(failure.retry_after)} if failure.status in (429, 503) else None
    return JSONResponse({"error": failure.message}, status_code=failure.status, headers=headers)


def ollama_router(bridge: EngineBridge, ctx: DaemonContext) -> APIRouter:
    router = APIRouter()

    @router.get("/")
    @router.head("/")
    async def root() -> Response:
        return PlainTextResponse("moed is running (OpenAI, Anthropic and Ollama APIs)")

    @router.get("/api/version")
    async def version() -> Response:
        return JSONResponse({"version": OLLAMA_API_VERSION, "moed": ctx.version})

    @router.get("/api/tags")
    async def list_models() -> Response:
        return JSONResponse(tags(ctx))

    @router.get("/api/ps")
    async def running() -> Response:
        return JSONResponse(ps(ctx))

    @router.post("/api/show")
    async def show_model(request: Request) -> Response:
        return JSONResponse(show(ctx, json_object(await request.body())))

    @router.delete("/api/delete")
    async def delete_model(request: Request) -> Response:
        delete(ctx, json_object(await request.body()))
        return JSONResponse({})

    @router.post("/api/pull")
    async def pull_model(request: Request) -> Response:
        return await ollama_pull(json_object(await request.body()))

    @router.post("/api/chat")
    async def chat(request: Request) -> Response:
        return await ollama_chat(bridge, await request.body(), request)

    @router.post("/api/generate")
    async def generate(request: Request) -> Response:
        return await ollama_generate(bridge, await request.body(), request)

    for path, why in NOT_OFFERED.items():
        router.add_api_route(path, _refusal(why), methods=["POST"])
    return router


def _refusal(why: str):
    async def refuse() -> Response:
        return JSONResponse({"error": f"not supported by moed: {why}"}, status_code=501)

    return refuse
