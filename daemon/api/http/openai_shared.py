"""What the OpenAI serving modules share: sampling parameters, finish reasons, SSE lines, error JSON, ids."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from moed.api.http.error_status import HttpFailure, ParamError, refuse_fields
from moed.api.http.openai_protocol import (ChoiceLogprobs, CompletionLogprobs, ErrorDetail, ErrorResponse,
                                           TokenLogprobOut, TopLogprob, Usage)
from moed.engine.request import Usage as EngineUsage
from moed.engine.sampling import MAX_SEED, SamplingParams
from moed.errors import ServiceUnavailableError
from moed.text.grammar import Grammar

# moed's engine finish reasons -> OpenAI's ("context": the prompt and output filled the context)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "deadline": "length"}
MAX_CHOICES = 16  # n: choices of one request (they share the prompt's K/V)
# OpenAI's default when a request omits temperature (the daemon's gRPC default is greedy)
DEFAULT_TEMPERATURE = 1.0
ERROR_TYPES = {"invalid_request": "invalid_request_error", "not_found": "invalid_request_error",
               "authentication": "authentication_error", "rate_limit": "rate_limit_error",
               "unavailable": "server_error", "internal": "server_error"}
ERROR_CODES = {"not_found": "model_not_found", "authentication": "invalid_api_key", "rate_limit": "queue_full",
               "unavailable": "service_unavailable", "internal": "internal_error"}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(failure: HttpFailure) -> dict[str, Any]:
    code = failure.code or ERROR_CODES.get(failure.kind)
    if failure.kind == "not_found" and failure.param != "model":
        code = None  # e.g. no such endpoint: OpenAI sends no code then
    detail = ErrorDetail(message=failure.message, type=ERROR_TYPES.get(failure.kind, "server_error"),
                         param=failure.param, code=code)
    return ErrorResponse(error=detail).model_dump()


def error_response(failure: HttpFailure) -> JSONResponse:
    headers = {"Retry-After": str(failure.retry_after)} if failure.status in (429, 503) else None
    if failure.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(failure), status_code=failure.status, headers=headers)


def finish_reason(engine_reason: str, *, has_tool_calls: bool) -> str:
    reason = FINISH_REASONS.get(engine_reason, "stop")
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def raise_if_failed(engine_reason: str, error: str = "") -> None:
    """A generation that ended in an engine error (-> 500) or was cancelled by the daemon (-> 503)."""
    if engine_reason == "error":
        raise RuntimeError(f"generation failed: {error}")
    if engine_reason == "cancelled":
        raise ServiceUnavailableError("the request was cancelled before it finished (the daemon is stopping or "
                                      "the model was unloaded)")


def usage_of(usage: EngineUsage | None) -> Usage:
    prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage is not None else (0, 0)
    cached = usage.cached_tokens if usage is not None else 0  # prompt tokens whose K/V came from the prefix cache
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details={"cached_tokens": cached})


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of n: the same parameters, a given seed moved on by ``index`` (so the choices differ)."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (MAX_SEED + 1))


def choices_usage(usages: list[EngineUsage | None]) -> Usage:
    """The usage of n choices of one prompt: the prompt once, every choice's output, and as cached tokens those
    each choice found in the prefix cache (so n = 4 of a P-token prompt shows about 3 P: prefilled once)."""
    first = usage_of(usages[0])
    completion = sum(u.completion_tokens for u in usages if u is not None)
    cached = sum(u.cached_tokens for u in usages if u is not None)
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                 total_tokens=first.prompt_tokens + completion, prompt_tokens_details={"cached_tokens": cached})


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def sampling_params(body: Any, *, max_tokens: int, stop: tuple[str, ...] = (), grammar: Grammar | None = None
                    ) -> SamplingParams:
    """SamplingParams from a request's OpenAI fields (range errors become 400s naming the field); ``grammar``:
    what the output must match (structured_output.py)."""
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    return SamplingParams(
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=getattr(body, "top_k", None) or 0,
        min_p=getattr(body, "min_p", None) or 0.0,
        repetition_penalty=getattr(body, "repetition_penalty", None) or 1.0,
        presence_penalty=getattr(body, "presence_penalty", None) or 0.0,
        frequency_penalty=getattr(body, "frequency_penalty", None) or 0.0,
        logit_bias=logit_bias(getattr(body, "logit_bias", None)),
        logprobs=requested_logprobs(body),
        seed=body.seed,
        max_tokens=max_tokens,
        stop=stop,
        grammar=grammar,
    )


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` ({"token id": bias}) as (id, bias) pairs; a key that is no token id is a 400."""
    if not bias:
        return ()
    out = []
    for key, value in bias.items():
        if not key.isdigit():
            raise ParamError(f"logit_bias keys must be token ids (strings of digits), got {key!r}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def requested_logprobs(body: Any) -> int | None:
    """How many alternatives per token a request asked for (None: no logprobs): chat's ``logprobs: true`` +
    ``top_logprobs``, completions' ``logprobs: N`` (at most 5, as OpenAI)."""
    value = getattr(body, "logprobs", None)
    top = getattr(body, "top_logprobs", None)
    if hasattr(body, "messages"):  # chat
        if value not in (None, False, True):
            raise ParamError("logprobs must be true or false on chat completions; give the number of alternatives as "
                             "top_logprobs", "logprobs")
        if top is not None and not value:
            raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if value else None
    if value is None or value is False:
        return None
    if value is True or not 0 <= value <= 5:
        raise ParamError(f"logprobs={value!r}: give the number of alternatives per token, 0 to 5", "logprobs")
    return value


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, entries) -> ChoiceLogprobs:
    """Engine ``TokenLogprob``s in Chat Completions' shape: the token's text, its bytes (exact, also for a token
    that holds part of a UTF-8 character, whose text shows U+FFFD), its log-probability and the alternatives."""
    out = []
    for e in entries:
        top = [TopLogprob(token=token_text(tokenizer, i), logprob=lp, bytes=list(tokenizer.token_bytes(i)))
               for i, lp in e.top]
        out.append(TokenLogprobOut(token=token_text(tokenizer, e.token_id), logprob=e.logprob,
                                   bytes=list(tokenizer.token_bytes(e.token_id)), top_logprobs=top))
    return ChoiceLogprobs(content=out)


def completion_logprobs(tokenizer, entries, offset: int = 0) -> CompletionLogprobs:
    """Engine ``TokenLogprob``s in the legacy completions' shape; ``offset``: the text before these tokens."""
    out = CompletionLogprobs()
    for e in entries:
        text = token_text(tokenizer, e.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({token_text(tokenizer, i): lp for i, lp in e.top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


# fields of the SDKs' requests that would change the answer in a way moed cannot (docs/api.md lists every field)
REFUSED_CHAT = {"audio": "moed's models write text only", "web_search_options": "moed has no web search",
                "functions": "it is deprecated; give the functions as tools",
                "function_call": "it is deprecated; use tool_choice"}
REFUSED_RESPONSES = {"background": "moed answers in the foreground (stream instead)",
                     "background_options": "moed answers in the foreground (stream instead)",
                     "conversation": "moed stores no conversations; send the whole conversation in 'input'",
                     "prompt": "moed has no stored prompt templates; send the instructions and input",
                     "max_tool_calls": "moed does not cap the calls of an answer (parallel_tool_calls: false makes "
                                       "it one)"}


def refuse_unsupported(body: Any) -> None:
    """400 for fields that would change the output in a way moed cannot honour."""
    modalities = getattr(body, "modalities", None) or []
    if "audio" in modalities:
        raise ParamError("modalities: audio output is not supported: moed's models write text only", "modalities")
    refuse_fields(body, REFUSED_CHAT if hasattr(body, "messages") else {})
    n = getattr(body, "n", None)
    if n is not None and n > MAX_CHOICES:
        raise ParamError(f"n={n}: at most {MAX_CHOICES} choices per request", "n")
    best_of = getattr(body, "best_of", None)
    if best_of not in (None, 1):
        raise ParamError(f"best_of={best_of} is not supported; leave it out", "best_of")


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event line with a JSON payload."""
    data = payload.model_dump(exclude_none=True) if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic
HEARTBEAT_S = 10.0  # a keep-alive comment when the model has been silent this long (long prefill)
