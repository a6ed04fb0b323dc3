"""SIGTERM: first one calls on_shutdown once, a second one exits at once (checked in a child process)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")

CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    from moed.service.signals import install_shutdown_handlers
    calls = []
    stop = threading.Event()
    def on_shutdown():
        calls.append(1)
        stop.set()
    restore = install_shutdown_handlers(on_shutdown)
    os.kill(os.getpid(), signal.SIGTERM)
    stop.wait(5)
    print("calls", len(calls), flush=True)
    if sys.argv[1] == "twice":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        print("still alive", flush=True)
    else:
        restore()
        print("restored", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
""")


def run_child(mode):
    return subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=30)


def test_first_signal_calls_on_shutdown_once_and_restore_puts_back_the_default():
    result = run_child("once")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["calls 1", "restored True"]


def test_second_signal_forces_exit():
    result = run_child("twice")
    assert "calls 1" in result.stdout and "still alive" not in result.stdout
    assert result.returncode == 128 + signal.SIGINT


def test_refused_outside_the_main_thread():
    import threading

    from moed.service.signals import install_shutdown_handlers

    errors = []
    thread = threading.Thread(target=lambda: errors.append(_try(install_shutdown_handlers)))
    thread.start()
    thread.join()
    assert "main thread" in errors[0]


def _try(install):
    try:
        install(lambda: None)
    except RuntimeError as exc:
        return str(exc)
    return "no error"
