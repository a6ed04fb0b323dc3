"""Turn the expert-engine command-line flags into an EngineConfig."""

from __future__ import annotations

import argparse

from moed.config import EngineConfig
from moed.errors import InvalidRequestError
from moed.experts.policy_spec import parse_policy


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    from moed.experts.policies import POLICY_NAMES

    name, options = parse_policy(args.policy)
    if name not in POLICY_NAMES:
        raise InvalidRequestError(f"--policy {name!r} is not one of {', '.join(POLICY_NAMES)}")
    return EngineConfig(device=args.device, cache_fraction=args.cache_fraction, policy=name, policy_options=options,
                        emulated_b_p=args.emulated_bp * 1e9, emulated_b_dev=args.emulated_bdev * 1e9)
