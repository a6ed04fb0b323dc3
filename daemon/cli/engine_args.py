"""Turn the expert-engine command-line flags into an EngineConfig."""

from __future__ import annotations

import argparse

from moed.config import EngineConfig
from moed.errors import InvalidRequestError


def parse_policy(text: str) -> tuple[str, tuple[tuple[str, float], ...]]:
    """``fixed-share:0.3`` -> ("fixed-share", (("cpu_share", 0.3),)); other names take no value."""
    name, _, value = text.partition(":")
    if name == "fixed-share":
        try:
            share = float(value) if value else 0.5
        except ValueError:
            raise InvalidRequestError(f"--policy {text!r}: write fixed-share:F with F a number in [0, 1]") from None
        if not 0.0 <= share <= 1.0:
            raise InvalidRequestError(f"--policy {text!r}: the CPU share F must be in [0, 1]")
        return name, (("cpu_share", share),)
    if value:
        raise InvalidRequestError(f"--policy {text!r}: only fixed-share takes a value (fixed-share:F)")
    return name, ()


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from moed.experts.policies import POLICY_NAMES

    name, options = parse_policy(args.policy)
    if name not in POLICY_NAMES:
        raise InvalidRequestError(f"--policy {name!r} is not one of {', '.join(POLICY_NAMES)}")
    return EngineConfig(device=args.device, cache_fraction=args.cache_fraction, policy=name, policy_options=options,
                        emulated_b_p=args.emulated_bp * 1e9, emulated_b_dev=args.emulated_bdev * 1e9)
