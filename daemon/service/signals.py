"""SIGTERM / SIGINT: the first one asks for an orderly shutdown, a second one exits at once."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

log = logging.getLogger(__name__)

SHUTDOWN_SIGNALS = ("SIGTERM", "SIGINT")


def install_shutdown_handlers(on_shutdown: Callable[[], None]) -> Callable[[], None]:
    """Make SIGTERM and SIGINT call `on_shutdown()` once; a second signal exits with 128 + signum.

    `on_shutdown` runs in the main thread between bytecodes: keep it short (set an event, ask the
    server to stop). Call this from the main thread; signals the platform lacks are skipped.
    Returns a function that puts the previous handlers back.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_shutdown_handlers must be called from the main thread")
    state = {"fired": False}

    def handler(signum: int, frame: object) -> None:
        if state["fired"]:
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(128 + signum)
        state["fired"] = True
        log.info("%s received: shutting down (send it again to exit at once)", signal.Signals(signum).name)
        try:
            on_shutdown()
        except Exception:
            log.exception("the shutdown handler failed")

    previous: dict[int, object] = {}
    for name in SHUTDOWN_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            previous[signum] = signal.signal(signum, handler)
        except (OSError, ValueError, RuntimeError):  # not settable on this platform
            continue

    def restore() -> None:
        for signum, old in previous.items():
            try:
                signal.signal(signum, old if old is not None else signal.SIG_DFL)
            except (OSError, ValueError, RuntimeError):
                pass

    return restore
