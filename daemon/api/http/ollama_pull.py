"""Ollama's ``/api/pull`` over moed's Hub pull (``moed.catalog.hub_pull``): the progress as Ollama streams it
(``pulling manifest``, ``pulling DIGEST`` with ``total`` / ``completed``, ``verifying sha256 digest``, ``success``;
a failure midway is an ``{"error": ...}`` line), or one ``{"status": "success"}`` with ``stream: false``.

moed pulls from the Hugging Face Hub, not from Ollama's registry: names are ``hf.co/ORG/REPO:QUANT`` (as Ollama
writes them) or ``ORG/REPO[:QUANT]``; an Ollama library name (``qwen3:30b``) gets a 400 that says so.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response

from moed.api.http.error_status import ParamError
from moed.api.http.sse_response import SseResponse

NDJSON = "application/x-ndjson"
REPORT_EVERY_S = 0.25


def _plan(name: str):
    from moed.catalog.hub_pull import plan_pull

    if not isinstance(name, str) or "/" not in name:
        raise ParamError(f"model {name!r}: moed pulls from the Hugging Face Hub, not Ollama's registry; give "
                         "hf.co/ORG/REPO:QUANT (e.g. hf.co/unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M)", "model")
    return plan_pull(name)


async def ollama_pull(data: dict) -> Response:
    from moed.catalog.hub_pull import pull

    name = data.get("model") or data.get("name")
    plan = await asyncio.to_thread(_plan, name)  # a bad name or an unreachable Hub: an error status, not a stream
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    digest = f"sha256:{plan.files[0].sha256 or plan.commit}" if plan.files else plan.commit
    last = [0.0]

    def put(obj) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, obj)

    def progress(what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if what == "downloading" and done < total and now - last[0] < REPORT_EVERY_S:
            return
        last[0] = now
        if what == "downloading":
            put({"status": f"pulling {digest[7:19]}", "digest": digest, "total": total, "completed": done})

    def work() -> None:
        try:
            pull(plan, progress=progress)
            put({"status": "verifying sha256 digest"})
            put({"status": "writing manifest"})
            put({"status": "success"})
        except Exception as exc:  # noqa: BLE001 - streamed to the client as Ollama does
            put({"error": str(exc)})
        finally:
            put(None)

    put({"status": "pulling manifest"})
    threading.Thread(target=work, name="moed-pull", daemon=True).start()

    async def lines() -> AsyncIterator[str]:
        while (obj := await queue.get()) is not None:
            yield json.dumps(obj) + "\n"

    if data.get("stream") is False:
        final = {}
        async for line in lines():
            final = json.loads(line)
        if "error" in final:
            return JSONResponse(final, status_code=500)
        return JSONResponse(final)
    return SseResponse(lines(), lambda: None, media_type=NDJSON)
