"""Several choices of one request streamed together (``n > 1`` with ``stream: true``): each choice is an async
iterator of SSE lines that already name its index; ``interleave`` runs the first alone until it has sent its
first output (its prompt is then in the prefix cache), then starts the others, which prefill only what no block
holds, and yields every choice's lines as they come. Keep-alives come from the first choice only."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from moed.api.http.openai_shared import SSE_KEEPALIVE

LINES_BEFORE_OUTPUT = 1  # a choice's first line is its role (chat) or its first text (completions: 0)


async def interleave(first: AsyncIterator[str], start_more: Callable[[], list[AsyncIterator[str]]], n: int, *,
                     lines_before_output: int = LINES_BEFORE_OUTPUT) -> AsyncIterator[str]:
    """The lines of ``first`` and of the ``n - 1`` iterators ``start_more()`` gives once ``first`` has sent
    ``lines_before_output + 1`` lines (or ended). The first exception of any choice is raised here; every task
    is cancelled however the iteration ends."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def run(lines: AsyncIterator[str], index: int) -> None:
        sent = 0
        try:
            async with contextlib.aclosing(lines):
                async for line in lines:
                    await queue.put(line)
                    sent += line is not SSE_KEEPALIVE
                    if index == 0 and sent == lines_before_output + 1 and len(tasks) == 1:
                        _start()
        except Exception as exc:  # noqa: BLE001 - raised by the consumer
            await queue.put(exc)
        finally:
            if index == 0 and len(tasks) == 1:  # it ended before any output: the others still run
                _start()
            await queue.put(None)

    def _start() -> None:
        tasks.extend(asyncio.create_task(run(lines, i)) for i, lines in enumerate(start_more(), start=1))

    tasks.append(asyncio.create_task(run(first, 0)))
    finished = 0
    try:
        while finished < n:
            item = await queue.get()
            if item is None:
                finished += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
