"""Map moed errors to gRPC status codes (a bad request never takes the daemon down)."""

from __future__ import annotations

import logging

import grpc

from moed import errors

log = logging.getLogger("moed.api")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, getattr(errors, "QueueFullError", ())):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, getattr(errors, "ModelNotFoundError", ())):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, errors.ServiceUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, getattr(errors, "InsufficientMemoryError", ())):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, errors.ModelExistsError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, errors.InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (errors.ModelFormatError, errors.UnsupportedModelError)):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, errors.MoedError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    log.exception("internal error while serving a call")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc} (see the daemon log)"


MAX_DETAILS_CHARS = 1000  # gRPC puts details in trailing metadata, which clients cap at a few KB


def one_line(message: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """An error's details as the client gets them: one line, at most ``limit`` characters."""
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[: limit - 15] + "... (truncated)"


def abort_with(context: grpc.ServicerContext, exc: BaseException):
    code, message = status_for(exc)
    context.abort(code, one_line(message))
