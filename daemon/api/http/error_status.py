"""What went wrong with an HTTP request, API-neutral: status code, kind, one-line message, the field at fault.

The OpenAI and Anthropic endpoints turn an ``HttpFailure`` into their own error JSON; both get it
from ``failure_of`` (moed errors, request-validation errors, anything unexpected).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from moed import errors
from moed.api.errors import one_line
from moed.api.http.access_log import note_error

log = logging.getLogger("moed.api.http")

MAX_MESSAGE_CHARS = 1000
MAX_VALIDATION_ERRORS = 5  # listed in one message; the rest are counted


@dataclass(frozen=True)
class HttpFailure:
    status: int
    kind: str  # invalid_request | authentication | not_found | rate_limit | unavailable | internal
    message: str
    param: str | None = None  # the request field at fault, where known
    code: str | None = None  # a machine-readable reason clients act on (e.g. "context_length_exceeded")
    retry_after: int = 1  # seconds, the Retry-After of a 429 / 503


class ParamError(errors.InvalidRequestError):
    """A bad request that names the field at fault (``param`` in OpenAI's error JSON)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def refuse_fields(body, refused: dict[str, str]) -> None:
    """400 naming the first field of ``refused`` (field -> why moed cannot honour it) that the request sets (not
    null, false or empty): a parameter that would change the answer in a way moed cannot is never ignored."""
    for field, why in refused.items():
        value = getattr(body, field, None)
        if value not in (None, False, "", [], {}):
            raise ParamError(f"{field} is not supported: {why}; leave it out", field)


class AuthenticationError(errors.MoedError):
    """No token, or the wrong one, on a daemon that requires one (HTTP 401)."""


def failure_of(exc: BaseException) -> HttpFailure:
    """The HTTP failure for an exception raised while serving a request (internal errors are logged; the
    message goes into the request's access-log line)."""
    failure = _failure_of(exc)
    note_error(failure.message)
    return failure


def _failure_of(exc: BaseException) -> HttpFailure:
    message = one_line(str(exc), MAX_MESSAGE_CHARS)
    if isinstance(exc, AuthenticationError):
        return HttpFailure(401, "authentication", message)
    if isinstance(exc, errors.ModelNotFoundError):
        return HttpFailure(404, "not_found", message, "model")
    if isinstance(exc, errors.QueueFullError):
        return HttpFailure(429, "rate_limit", message)
    if isinstance(exc, errors.ServiceUnavailableError):
        return HttpFailure(503, "unavailable", message, retry_after=exc.retry_after)
    if isinstance(exc, errors.InsufficientMemoryError):
        return HttpFailure(503, "unavailable", message)
    if isinstance(exc, errors.InvalidRequestError):
        return HttpFailure(400, "invalid_request", message, getattr(exc, "param", None), getattr(exc, "code", None))
    if isinstance(exc, errors.MoedError):  # a broken chat template, an unsupported model: the model's fault
        return HttpFailure(400, "invalid_request", message)
    log.error("internal error while serving an HTTP request", exc_info=exc)
    return HttpFailure(500, "internal",
                       one_line(f"internal error: {type(exc).__name__}: {exc} (see the daemon log)", MAX_MESSAGE_CHARS))


def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def validation_failure(problems: list[dict[str, Any]]) -> HttpFailure:
    """One 400 for pydantic's / FastAPI's list of validation problems: the first few, each with its field."""
    if any(p.get("type") == "json_invalid" for p in problems):
        detail = next(p for p in problems if p.get("type") == "json_invalid")
        where = detail.get("ctx", {}).get("error", "")
        return HttpFailure(400, "invalid_request", one_line(
            f"the request body is not valid JSON ({where}); send a JSON object", MAX_MESSAGE_CHARS))
    texts = []
    for p in problems[:MAX_VALIDATION_ERRORS]:
        where = _location(tuple(p.get("loc", ())))
        msg = str(p.get("msg", "invalid"))
        if p.get("type") == "missing":
            texts.append(f"'{where}' is required")
        elif p.get("type") == "model_attributes_type" or (where == "" and "dictionary" in msg):
            texts.append("the request body must be a JSON object")
        else:
            got = p.get("input")
            shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {errors.quoted(got, 60)})"
            texts.append(f"'{where}': {msg}{shown}" if where else f"{msg}{shown}")
    more = len(problems) - MAX_VALIDATION_ERRORS
    tail = f"; and {more} more problem{'s' * (more > 1)}" if more > 0 else ""
    first = _location(tuple(problems[0].get("loc", ()))) if problems else None
    return HttpFailure(400, "invalid_request", one_line("invalid request: " + "; ".join(texts) + tail,
                                                        MAX_MESSAGE_CHARS), first or None)
