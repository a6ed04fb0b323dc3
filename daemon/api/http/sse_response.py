"""SseResponse: a text/event-stream response that cancels its engine request however the response ends."""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class SseResponse(StreamingResponse):
    """Streams ``events`` (SSE text); ``cancel`` runs when the response ends, completed or not.

    Starlette cancels a streaming response when the client disconnects; if that happens before
    the body iterator has started, the iterator's own clean-up never runs, so the request would
    go on generating for nobody. ``cancel`` (e.g. ``GenerationStream.cancel``) closes that gap;
    after a completed answer it does nothing.
    """

    def __init__(self, events: AsyncIterable[str], cancel: Callable[[], object],
                 media_type: str = "text/event-stream") -> None:
        """``media_type``: Ollama's streams are NDJSON (``application/x-ndjson``), one JSON object a line."""
        super().__init__(events, media_type=media_type, headers=STREAM_HEADERS)
        self._cancel = cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cancel()
