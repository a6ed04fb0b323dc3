"""Error types that carry a message meant for a person: what was wrong, where, and what to do."""


class MoedError(Exception):
    """Base class: the CLI prints the message (no traceback) and exits with status 2."""


class ModelFormatError(MoedError):
    """A model directory or file is missing, corrupt, truncated or inconsistent."""


class UnsupportedModelError(MoedError):
    """The checkpoint's architecture is not one moed implements."""


class InvalidRequestError(MoedError):
    """A request parameter is out of range (sampling, prompt length, ...)."""
