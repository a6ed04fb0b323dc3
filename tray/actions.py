"""Tray actions: a menu action id -> an RPC through MoedClient (or a local step); errors become a message."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moed.api.client import DaemonUnavailableError, MoedClient
from moed.errors import MoedError
from moed_tray import menu_model as m

START_WAIT_S = 60.0  # a cold `moed serve` imports torch and numba: several seconds on a small machine
DAEMON_OUTPUT_NAME = "daemon-started-by-tray.out"


@dataclass(frozen=True)
class ActionResult:
    ok: bool
    message: str  # shown as a notification when not ok; a short confirmation when ok


def open_command(path: Path, platform: str = sys.platform) -> list[str] | None:
    """The command that opens a folder in the desktop's file manager (None: use os.startfile on Windows)."""
    if platform.startswith("win"):
        return None
    if platform == "darwin":
        return ["open", str(path)]
    return ["xdg-open", str(path)]


def serve_command(address: str) -> list[str]:
    """`moed serve` on the tray's address, with this interpreter (the tray and daemon share one install)."""
    return [sys.executable, "-m", "moed.cli.main", "serve", "--socket", address]


class TrayActions:
    def __init__(self, address: str, *, log_dir: Path, token: str | None = None, timeout: float = 10.0,
                 spawn_env: dict | None = None, opener: Callable[[Path], None] | None = None,
                 start_wait_s: float = START_WAIT_S) -> None:
        self.address = address
        self.log_dir = Path(log_dir)
        self.token = token
        self.timeout = timeout
        self.spawn_env = spawn_env
        self.opener = opener or self._open_folder
        self.start_wait_s = start_wait_s

    def run(self, action: str, args: tuple = ()) -> ActionResult:
        """Perform one action; never raises (a failure comes back as ActionResult(ok=False, message))."""
        handlers = {
            m.LOAD: self._load, m.UNLOAD: self._unload, m.CAP_AUTO: self._cap_auto,
            m.CAP_FRACTION: self._cap_fraction, m.CAP_BYTES: self._cap_bytes, m.PAUSE: self._pause,
            m.RESUME: self._resume, m.STOP_DAEMON: self._stop, m.START_DAEMON: self._start, m.OPEN_LOGS: self._logs,
        }
        handler = handlers.get(action)
        if handler is None:
            return ActionResult(False, f"the tray has no action {action!r}")
        try:
            return handler(*args)
        except DaemonUnavailableError:
            return ActionResult(False, f"no moed daemon is running at {self.address}; choose Start daemon")
        except MoedError as exc:
            return ActionResult(False, str(exc))
        except Exception as exc:  # a tray action must never take the tray down
            return ActionResult(False, f"{action} failed: {type(exc).__name__}: {exc}")

    def _client(self, timeout: float | None = None) -> MoedClient:
        return MoedClient(self.address, token=self.token, timeout=timeout or self.timeout)

    # -- RPCs ---------------------------------------------------------------------------------
    def _load(self, model: str) -> ActionResult:
        with self._client() as client:
            final = None
            for progress in client.load(model):
                final = progress
        name = final.model.name if final is not None and final.HasField("model") else model
        return ActionResult(True, f"loaded {name}")

    def _unload(self, name: str) -> ActionResult:
        with self._client() as client:
            client.unload(name)
        return ActionResult(True, f"unloaded {name}")

    def _cap_auto(self) -> ActionResult:
        with self._client() as client:
            client.set_vram_cap(0)
        return ActionResult(True, "VRAM cap: auto")

    def _cap_fraction(self, fraction: float) -> ActionResult:
        with self._client() as client:
            status = client.set_vram_cap(0, fraction)
        return ActionResult(True, f"VRAM cap: {fraction:.0%} ({m.gb(status.memory.cap_bytes)})")

    def _cap_bytes(self, cap_bytes: int) -> ActionResult:
        with self._client() as client:
            client.set_vram_cap(int(cap_bytes))
        return ActionResult(True, f"VRAM cap: {m.gb(cap_bytes)}")

    def _pause(self) -> ActionResult:
        with self._client() as client:
            client.set_serving(paused=True)
        return ActionResult(True, "serving paused")

    def _resume(self) -> ActionResult:
        with self._client() as client:
            client.set_serving(paused=False)
        return ActionResult(True, "serving resumed")

    def _stop(self) -> ActionResult:
        with self._client() as client:
            client.shutdown(cancel_inflight=False)
        return ActionResult(True, "daemon stopping (running requests finish first)")

    # -- local steps ------------------------------------------------------------------------------
    def _start(self) -> ActionResult:
        """Spawn `moed serve` detached on our address, then wait until it answers (or exits)."""
        if self._answers():
            return ActionResult(True, f"a daemon is already running at {self.address}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out_path = self.log_dir / DAEMON_OUTPUT_NAME
        with open(out_path, "ab") as out:
            kwargs: dict = {}
            if sys.platform.startswith("win"):
                kwargs["creationflags"] = subprocess.DETACHED_PROCESS | subprocess.CREATE_NEW_PROCESS_GROUP
            else:
                kwargs["start_new_session"] = True  # not killed with the tray or its terminal
            proc = subprocess.Popen(serve_command(self.address), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=self.spawn_env, **kwargs)
        threading.Thread(target=proc.wait, daemon=True, name="moed-tray-reaper").start()
        deadline = time.monotonic() + self.start_wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = out_path.read_text(errors="replace").strip().splitlines()[-3:]
                return ActionResult(False, f"the daemon exited at start ({proc.returncode}): " + " | ".join(tail))
            if self._answers():
                return ActionResult(True, f"daemon started (pid {proc.pid})")
            time.sleep(0.2)
        return ActionResult(False, f"the daemon did not answer within {self.start_wait_s:.0f} s; see {out_path}")

    def _answers(self) -> bool:
        try:
            with self._client(timeout=1.0) as client:
                client.status()
            return True
        except MoedError:
            return False

    def _logs(self) -> ActionResult:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.opener(self.log_dir)
        except OSError as exc:
            return ActionResult(False, f"cannot open the log folder {self.log_dir}: {exc}")
        return ActionResult(True, f"logs are in {self.log_dir}")

    @staticmethod
    def _open_folder(path: Path) -> None:
        command = open_command(path)
        if command is None:
            os.startfile(str(path))  # type: ignore[attr-defined]  # Windows only
            return
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
