"""POST /v1/completions: a plain prompt (no chat template) -> the engine -> text, streamed or whole."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from moed.api.http.bridge import EngineBridge
from moed.api.http.choice_streams import interleave
from moed.api.http.error_status import ParamError, failure_of
from moed.api.http.openai_protocol import Completion, CompletionChoice, CompletionRequest
from moed.api.http.openai_shared import (HEARTBEAT_S, SSE_DONE, SSE_KEEPALIVE, completion_logprobs, error_body,
                                         choice_params, choices_usage, finish_reason, new_id, now, raise_if_failed,
                                         refuse_unsupported, sampling_params, sse, stop_strings, usage_of)
from moed.api.http.sse_response import SseResponse
from moed.api.http.structured_output import extension_grammar


def prompt_ids_of(bridge: EngineBridge, entry, prompt: str | list[str] | list[int]) -> list[int]:
    """One prompt: a string, a list holding one string, or token ids."""
    if isinstance(prompt, str):
        return bridge.encode(entry, prompt)
    if prompt and all(isinstance(p, int) for p in prompt):
        return list(prompt)  # token ids; the engine checks them against the vocabulary
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return bridge.encode(entry, prompt[0])
    raise ParamError(f"prompt is a list of {len(prompt)} prompts; moed completes one prompt per request: send a "
                     "string (or a list of token ids)", "prompt")


async def create_completion(bridge: EngineBridge, body: CompletionRequest, request: Request):
    refuse_unsupported(body)
    if body.echo:
        raise ParamError("echo is not supported; leave it out (the prompt is yours already)", "echo")
    if body.suffix:
        raise ParamError("suffix (fill-in-the-middle) is not supported; leave it out", "suffix")
    entry = await bridge.acquire(body.model)
    prompt_ids = prompt_ids_of(bridge, entry, body.prompt)
    bridge.check_prompt_fits(entry, prompt_ids)
    # OpenAI's documented default for completions is 16 tokens; never more than the context has room for
    max_tokens = min(body.max_tokens or 16, bridge.default_max_tokens(entry, prompt_ids))
    params = sampling_params(body, max_tokens=max_tokens, stop=stop_strings(body.stop), grammar=extension_grammar(body))
    stream = bridge.open_stream(entry, prompt_ids, params)
    cmpl_id, created = new_id("cmpl-"), now()
    tokenizer = bridge.tokenizer(entry) if params.logprobs is not None else None
    n = body.n or 1
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        streams = [stream]

        def start_more():
            more = [bridge.open_stream(entry, prompt_ids, choice_params(params, i)) for i in range(1, n)]
            streams.extend(more)
            return more

        return SseResponse(_chunks(streams, start_more, n, cmpl_id, created, entry.name, include_usage, tokenizer),
                           lambda: [s.cancel() for s in streams])
    outputs = [([], [], [None]) for _ in range(n)]  # per choice: texts, logprobs, done event

    async def drain(gen, out) -> None:
        async with contextlib.aclosing(gen):
            async for event in gen:
                if event is not None:
                    out[0].append(event.text)
                    out[1].extend(event.logprobs)
                    out[2][0] = event if event.done else None

    first = stream.events(is_disconnected=request.is_disconnected)
    more = []
    try:
        async with contextlib.aclosing(first):
            async for event in first:  # the first choice runs alone until its prompt is in the prefix cache
                if event is not None:
                    outputs[0][0].append(event.text)
                    outputs[0][1].extend(event.logprobs)
                    outputs[0][2][0] = event if event.done else None
                    if n > 1:
                        more = [bridge.open_stream(entry, prompt_ids, choice_params(params, i)) for i in range(1, n)]
                        break
            await asyncio.gather(drain(first, outputs[0]), *[
                drain(s.events(is_disconnected=request.is_disconnected), outputs[i + 1]) for i, s in enumerate(more)])
    finally:
        for s in more:
            s.cancel()
    if any(done[0] is None for _, _, done in outputs):
        return JSONResponse({}, status_code=499)  # the client left
    choices = []
    for index, (text, logprobs, (done,)) in enumerate(outputs):
        raise_if_failed(done.finish_reason, done.error)
        choices.append(CompletionChoice(index=index, text="".join(text),
                                        finish_reason=finish_reason(done.finish_reason, has_tool_calls=False),
                                        logprobs=completion_logprobs(tokenizer, logprobs) if tokenizer is not None
                                        else None))
    answer = Completion(id=cmpl_id, created=created, model=entry.name, choices=choices,
                        usage=choices_usage([done.usage for _, _, (done,) in outputs]))
    return JSONResponse(answer.model_dump(exclude_none=True))


async def _chunks(streams: list, start_more, n: int, cmpl_id: str, created: int, model: str,
                  include_usage: bool, tokenizer=None) -> AsyncIterator[str]:
    """The stream of ``n`` choices (``choice_streams.interleave`` for more than one: the first runs alone until
    its prompt is cached), then the usage and ``[DONE]``."""
    usages: list[list] = [[] for _ in range(n)]

    def lines(stream, index: int) -> AsyncIterator[str]:
        return _choice_chunks(stream, index, cmpl_id, created, model, tokenizer, usages[index], keepalive=index == 0)

    try:
        if n == 1:
            choices = lines(streams[0], 0)
        else:
            choices = interleave(lines(streams[0], 0), lambda: [lines(s, i) for i, s in enumerate(start_more(), 1)],
                                 n, lines_before_output=0)
        async for line in choices:
            yield line
        if include_usage:
            usage = (usage_of(usages[0][0] if usages[0] else None) if n == 1
                     else choices_usage([u[0] if u else None for u in usages]))
            yield sse(Completion(id=cmpl_id, created=created, model=model, choices=[], usage=usage))
        yield SSE_DONE
    except Exception as exc:  # the status line is long gone: report it in the stream (the SDKs raise it)
        yield sse(error_body(failure_of(exc)))
        yield SSE_DONE
    finally:
        for s in streams:
            s.cancel()


async def _choice_chunks(stream, index: int, cmpl_id: str, created: int, model: str, tokenizer, usages: list, *,
                         keepalive: bool = True) -> AsyncIterator[str]:
    """One choice's chunks (text, log-probabilities, the finish reason); its usage appended to ``usages``."""
    offset = 0

    def chunk(text: str, reason: str | None = None, entries=()) -> str:
        nonlocal offset
        logprobs = completion_logprobs(tokenizer, entries, offset) if tokenizer is not None and entries else None
        offset += len(text)
        return sse(Completion(id=cmpl_id, created=created, model=model, choices=[
            CompletionChoice(index=index, text=text, finish_reason=reason, logprobs=logprobs)]))

    async for event in stream.events(heartbeat_s=HEARTBEAT_S):
        if event is None:
            if keepalive:
                yield SSE_KEEPALIVE
        elif not event.done:
            if event.text or (tokenizer is not None and event.logprobs):
                yield chunk(event.text, entries=event.logprobs)
        else:
            raise_if_failed(event.finish_reason, event.error)
            yield chunk(event.text, finish_reason(event.finish_reason, has_tool_calls=False))
            usages.append(event.usage)
            return
