"""A test-only seam: $MOED_TEST_RUNTIME_HOOK names a function that may replace a loaded model's runtime.

End-to-end tests drive a real `moed serve` process with real clients (the coding agents) and a real
model directory (the demo model: its tokenizer, chat template, config, context); for a tiny model to
call a tool on cue, the test puts a scripted logits source in front of the loaded model. The hook is a
``module:function`` importable by the daemon process (the test sets PYTHONPATH); the function gets the
ModelRuntime and returns the one to serve. Every use is logged as a warning, since a daemon with a hook
does not answer from its weights.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable

from moed import config
from moed.errors import InvalidRequestError

log = logging.getLogger("moed.engine")


def load_hook(spec: str) -> Callable:
    """The function ``spec`` ("package.module:function") names; InvalidRequestError saying what is wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidRequestError(f"$MOED_TEST_RUNTIME_HOOK={spec!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidRequestError(f"$MOED_TEST_RUNTIME_HOOK={spec!r}: cannot import {module_name}: {e}. "
                                  "Unset it unless a test set it.") from e
    hook = getattr(module, attr, None)
    if not callable(hook):
        raise InvalidRequestError(f"$MOED_TEST_RUNTIME_HOOK={spec!r}: {module_name} has no function {attr}")
    return hook


def apply_runtime_hook(runtime, name: str, spec: str | None = None):
    """``runtime`` as the hook in $MOED_TEST_RUNTIME_HOOK (or ``spec``) returns it; unchanged without one."""
    spec = spec if spec is not None else config.test_runtime_hook()
    if not spec:
        return runtime
    hooked = load_hook(spec)(runtime)
    log.warning("test hook %s: model %r answers from it, not from its weights (unset MOED_TEST_RUNTIME_HOOK "
                "outside tests)", spec, name)
    return hooked
