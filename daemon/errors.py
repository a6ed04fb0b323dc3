"""Error types that carry a message meant for a person: what was wrong, where, and what to do."""


class MoedError(Exception):
    """Base class: the CLI prints the message (no traceback) and exits with status 2."""


class ModelFormatError(MoedError):
    """A model directory or file is missing, corrupt, truncated or inconsistent."""


class UnsupportedModelError(MoedError):
    """The checkpoint's architecture is not one moed implements."""


class InvalidRequestError(MoedError):
    """A request parameter is out of range (sampling, prompt length, ...)."""


class ModelExistsError(InvalidRequestError):
    """A model of that name is already loaded (or being loaded)."""


class InsufficientMemoryError(MoedError):
    """Not enough host RAM (or VRAM) for what was asked; the message says how much and what to do."""


class AlreadyRunningError(MoedError):
    """Another moed daemon of this user holds the instance lock; the message says where it listens."""

    def __init__(self, message: str, *, pid: int | None = None, address: str | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.address = address


class QueueFullError(MoedError):
    """The engine's waiting queue is full; the request was not accepted (retry later)."""


class ModelNotFoundError(InvalidRequestError):
    """A request names a model that is not loaded (HTTP 404; the message lists the loaded ones)."""


class ServiceUnavailableError(MoedError):
    """The daemon cannot serve this now (paused, a model still loading, shutting down); retry later."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))  # seconds, sent as HTTP Retry-After


MAX_QUOTED_CHARS = 200


def quoted(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: an error must never
    echo a whole 100 KB input back (gRPC refuses metadata that large, and logs fill up)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
