"""build_app: the FastAPI app of the HTTP gateway (routes, token check, errors in each API's own shape).

Routes: ``GET /health`` (no token), ``GET /metrics`` (Prometheus text), ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/responses``, the Anthropic endpoints when
``moed.api.http.anthropic_messages`` is present (see ``_include_anthropic``), and Ollama's ``/api/*``
(``ollama_api.py``). Errors are
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` except under a path prefix that
registered its own shape (``register_error_shape``).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from moed import __version__
from moed.api.daemon_context import DaemonContext
from moed.api.http.access_log import AccessLog
from moed.api.http.bridge import EngineBridge
from moed.api.http.error_status import AuthenticationError, HttpFailure, failure_of, validation_failure
from moed.api.http.metrics import RequestCounter, render_metrics
from moed.api.http.openai_chat import create_chat_completion
from moed.api.http.openai_completions import create_completion
from moed.api.http.openai_protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList,
                                           ResponsesRequest)
from moed.api.http.openai_responses import create_response
from moed.api.http.openai_shared import error_response
from moed.errors import MoedError

ErrorShape = Callable[[HttpFailure], Response]
OPEN_PATHS = frozenset({"/health"})  # no token needed: reveals only whether the daemon is up


def register_error_shape(app: FastAPI, path_prefix: str, render: ErrorShape) -> None:
    """Errors of requests under ``path_prefix`` are rendered by ``render`` (e.g. Anthropic's shape)."""
    app.state.error_shapes.append((path_prefix, render))


def render_failure(app: FastAPI | ASGIApp, path: str, failure: HttpFailure) -> Response:
    for prefix, render in getattr(getattr(app, "state", None), "error_shapes", ()):
        if path.startswith(prefix):
            return render(failure)
    return error_response(failure)


def token_of(headers: dict[str, str]) -> str | None:
    """The token a request sent: ``Authorization: Bearer TOKEN`` or ``x-api-key: TOKEN``."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


class TokenCheck:
    """ASGI middleware: every path but /health needs the daemon's token (constant-time compare)."""

    def __init__(self, app: ASGIApp, *, token: str, fastapi_app: FastAPI) -> None:
        self.app = app
        self._token = token.encode()
        self._fastapi_app = fastapi_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        sent = token_of(headers)
        if sent is not None and hmac.compare_digest(sent.encode(), self._token):
            return await self.app(scope, receive, send)
        what = "no token was sent" if sent is None else "the token is wrong"
        failure = failure_of(AuthenticationError(
            f"this moed daemon requires a token and {what}: send 'Authorization: Bearer TOKEN' or 'x-api-key: "
            "TOKEN' (the token of `moed serve --token-file`)"))
        response = render_failure(self._fastapi_app, scope["path"], failure)
        await response(scope, receive, send)


def build_app(ctx: DaemonContext, *, token: str | None) -> FastAPI:
    """The gateway's app over the daemon's context (its models and engine loops, shared with gRPC)."""
    app = FastAPI(title="moed", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.error_shapes = []
    bridge = EngineBridge(ctx)
    app.state.bridge = bridge

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return render_failure(app, request.url.path, validation_failure(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "invalid_request"
        message = (f"no such endpoint: {request.method} {request.url.path}; moed serves /v1/models, "
                   "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, Ollama's /api/chat, "
                   "/api/generate, /api/tags, /api/show, /api/ps, /api/pull, /api/delete, /api/version, /metrics and "
                   "/health"
                   if exc.status_code in (404, 405) else str(exc.detail))
        return render_failure(app, request.url.path, HttpFailure(exc.status_code, kind, message))

    @app.exception_handler(MoedError)
    async def _moed(request: Request, exc: MoedError) -> Response:  # 4xx / 503 with the message for people
        return render_failure(app, request.url.path, failure_of(exc))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:  # 500 in the API's shape (starlette logs it)
        return render_failure(app, request.url.path, failure_of(exc))

    @app.get("/health")
    async def health() -> Response:
        state = ctx.state()
        if state in ("loading", "stopping"):
            return JSONResponse({"status": state}, status_code=503)
        return JSONResponse({"status": "ok", "state": state, "models": [m.name for m in bridge.models()]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(render_metrics(bridge.metrics, ctx), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        """Loaded models; with load on demand also every model on disk a request may name (as Ollama's OpenAI
        endpoint lists its local models)."""
        cards = [ModelCard(id=m.name, created=m.created, context_length=m.context_length,
                           max_model_len=m.context_length) for m in bridge.models()]
        if ctx.pool is not None:
            listed = {c.id for c in cards}
            cards += [ModelCard(id=f.name, created=int(f.modified), context_length=None, max_model_len=None,
                                loaded=False) for f in ctx.manager.catalog.list() if f.name not in listed]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(bridge, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(bridge, body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(bridge, body, request)

    _include_anthropic(app, bridge)
    from moed.api.http import ollama_api

    app.include_router(ollama_api.ollama_router(bridge, ctx))
    register_error_shape(app, ollama_api.ERROR_PATH_PREFIX, ollama_api.ollama_error_response)
    if token:
        app.add_middleware(TokenCheck, token=token, fastapi_app=app)
    app.add_middleware(RequestCounter, metrics=bridge.metrics)  # refused requests count too
    app.add_middleware(AccessLog)  # outermost: one line per request, refused ones included
    return app


def _include_anthropic(app: FastAPI, bridge: EngineBridge) -> None:
    """The Anthropic endpoints, from ``moed.api.http.anthropic_messages`` when it is present.

    That module provides ``anthropic_router(bridge) -> APIRouter`` and may provide
    ``ERROR_PATH_PREFIX`` with ``anthropic_error_response(failure: HttpFailure) -> Response``,
    which renders errors (401, validation, moed errors) under that prefix in Anthropic's shape.
    """
    try:
        from moed.api.http import anthropic_messages
    except ModuleNotFoundError as exc:
        if exc.name != "moed.api.http.anthropic_messages":
            raise
        return
    app.include_router(anthropic_messages.anthropic_router(bridge))
    render = getattr(anthropic_messages, "anthropic_error_response", None)
    if render is not None:
        register_error_shape(app, getattr(anthropic_messages, "ERROR_PATH_PREFIX", "/v1/messages"), render)
