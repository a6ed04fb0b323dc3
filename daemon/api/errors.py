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
    if isinstance(exc, getattr(errors, "InsufficientMemoryError", ())):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, errors.InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (errors.ModelFormatError, errors.UnsupportedModelError)):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, errors.MoedError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    log.exception("internal error while serving a call")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc} (see the daemon log)"


def abort_with(context: grpc.ServicerContext, exc: BaseException):
    code, message = status_for(exc)
    context.abort(code, message)
