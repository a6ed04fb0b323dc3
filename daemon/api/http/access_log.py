"""The HTTP access log: one line per request in the daemon log (and so in `moed logs`).

    127.0.0.1:50412 "POST /v1/messages" 200 model=demo-moe-ftw prompt=22614 cached=22598 generated=41
        ttft=0.84s time=2.31s finish=eos

The line is written when the response has been sent to the end (a stream's last event), or when the
client left: then with ``client_left``. ``AccessLog`` (ASGI middleware, outermost) opens an
``AccessRecord`` per request in a context variable; the engine bridge fills in the model and the
token figures when the stream ends, and ``error_status.failure_of`` the error text of a failed
request, including one that failed mid-stream after its 200 status line had gone out.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("moed.access")
MAX_ERROR_CHARS = 300
QUIET_PATHS = ("/health", "/metrics")  # answered 200: logged at debug level


@dataclass
class AccessRecord:
    model: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    generated_tokens: int | None = None
    ttft_s: float | None = None
    finish: str = ""
    error: str = ""


_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar("moed_access_record", default=None)


def current_record() -> AccessRecord | None:
    """The access record of the HTTP request being served here (None outside one)."""
    return _current.get()


def note_error(message: str) -> None:
    record = _current.get()
    if record is not None and not record.error:
        record.error = message[:MAX_ERROR_CHARS]


def access_line(client: str, method: str, path: str, status: int | None, record: AccessRecord, seconds: float,
                *, client_left: bool = False) -> str:
    parts = [f'{client} "{method} {path}" {status if status is not None else "-"}']
    if record.model:
        parts.append(f"model={record.model}")
    for name, value in (("prompt", record.prompt_tokens), ("cached", record.cached_tokens),
                        ("generated", record.generated_tokens)):
        if value is not None:
            parts.append(f"{name}={value}")
    if record.ttft_s is not None:
        parts.append(f"ttft={record.ttft_s:.2f}s")
    parts.append(f"time={seconds:.2f}s")
    if record.finish:
        parts.append(f"finish={record.finish}")
    if client_left:
        parts.append("client_left")
    if record.error:
        parts.append(f"error={record.error!r}")
    return " ".join(parts)


class AccessLog:
    """ASGI middleware: one access line per HTTP request (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord()
        token = _current.set(record)
        started = time.monotonic()
        status: int | None = None
        finished = False

        async def logging_send(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True

        try:
            await self.app(scope, receive, logging_send)
        finally:
            _current.reset(token)
            client = scope.get("client") or ("-", 0)
            path = scope.get("path", "")
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
            line = access_line(f"{client[0]}:{client[1]}", scope.get("method", ""), path, status, record,
                               time.monotonic() - started, client_left=not finished)
            if scope.get("path") in QUIET_PATHS and status == 200:
                log.debug(line)  # the tray and load balancers poll these every few seconds
            else:
                (log.warning if (status or 500) >= 500 else log.info)(line)
