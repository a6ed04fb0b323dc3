"""Parse a policy name as users write it (``adaptive``, ``fixed-share:0.3``) into name + options."""

from __future__ import annotations

from moed.errors import InvalidRequestError, quoted


def parse_policy(text: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """``fixed-share:0.3`` -> ("fixed-share", (("cpu_share", 0.3),)); other names take no value."""
    name, _, value = text.partition(":")
    if name == "fixed-share":
        try:
            share = float(value) if value else 0.5
        except ValueError:
            raise InvalidRequestError(f"--policy {quoted(text)}: write fixed-share:F with F a number in [0, 1]") from None
        if not 0.0 <= share <= 1.0:
            raise InvalidRequestError(f"--policy {quoted(text)}: the CPU share F must be in [0, 1]")
        return name, (("cpu_share", share),)
    if value:
        raise InvalidRequestError(f"--policy {quoted(text)}: only fixed-share takes a value (fixed-share:F)")
    return name, ()
