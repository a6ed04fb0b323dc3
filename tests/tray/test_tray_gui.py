"""The tray on a real (virtual) desktop: Xvfb + a tray host (trayer) + the gtk backend, against a real daemon.

The icon must dock, a right click must open the menu, choosing "Pause serving" must reach the daemon
(seen through GetStatus), and "Quit tray" must end the app. A screenshot of the open menu is saved to
docs/img/tray-menu.png. Skips only when no X server can be started (Xvfb missing).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.daemon_process import start_daemon

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "img" / "tray-menu.png"
INSTALL_HINT = "install the desktop test packages with .ci/install-gui-deps.sh"
PANEL_HEIGHT = 32

pytestmark = pytest.mark.skipif(shutil.which("Xvfb") is None,
                                reason=f"no display server can be started here: Xvfb is not installed ({INSTALL_HINT})")


def need(tool: str) -> str:
    path = shutil.which(tool)
    assert path, f"{tool} is missing though Xvfb is installed; {INSTALL_HINT}"
    return path


def wait_for(predicate, timeout: float, what, step: float = 0.1):
    """Poll until predicate() is truthy; `what` (a string, or a callable for late details) names the wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")


def start_xvfb() -> tuple[subprocess.Popen, str]:
    """Xvfb on a free display number (it picks one and writes it to -displayfd)."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(["Xvfb", "-displayfd", str(write_fd), "-screen", "0", "640x480x24", "-nolisten", "tcp"],
                            pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        number = pipe.readline().strip()
    if not number:
        proc.kill()
        pytest.skip("no display server could be started: Xvfb exited without a display number")
    return proc, f":{number}"


def xdotool(env: dict, *args: str) -> str:
    result = subprocess.run(["xdotool", *args], env=env, capture_output=True, text=True, timeout=10)
    return result.stdout.strip() if result.returncode == 0 else ""


def geometry(env: dict, wid: str) -> tuple[int, int, int, int]:
    shell = xdotool(env, "getwindowgeometry", "--shell", wid)
    values = dict(line.split("=", 1) for line in shell.splitlines() if "=" in line)
    return tuple(int(values.get(k, -1)) for k in ("X", "Y", "WIDTH", "HEIGHT"))


def docked_icon(env: dict, title_prefix: str) -> tuple[int, int, int, int] | None:
    """(x, y, w, h) of the docked icon, found by its title, once it sits inside the panel."""
    for wid in xdotool(env, "search", "--name", f"^{title_prefix}").split():
        x, y, w, h = geometry(env, wid)
        if 0 <= y < PANEL_HEIGHT and 8 <= w <= 64 and 8 <= h <= 64:
            return x, y, w, h
    return None


def open_menu(env: dict) -> tuple[int, int, int, int] | None:
    """(x, y, w, h) of the tray's popup menu while it is shown (a visible moed-tray window below the panel)."""
    for wid in xdotool(env, "search", "--onlyvisible", "--class", "moed-tray").split():
        x, y, w, h = geometry(env, wid)
        if y >= PANEL_HEIGHT - 2 and w >= 100 and h >= 60:
            return x, y, w, h
    return None


def right_click(env: dict, icon: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    x, y, w, h = icon
    xdotool(env, "mousemove", str(x + w // 2), str(y + h // 2))
    xdotool(env, "click", "3")  # the gtk backend pops the menu up on a right click
    return wait_for(lambda: open_menu(env), 10, "the tray menu to open after a right click on the icon")


def test_tray_docks_opens_menu_and_pauses_serving(tmp_path, tray_models_dir):
    for tool in ("trayer", "xdotool", "import", "dbus-run-session"):
        need(tool)
    probe = subprocess.run([sys.executable, "-c", "import gi; gi.require_version('Gtk', '3.0')"], capture_output=True)
    assert probe.returncode == 0, f"PyGObject/GTK missing in the venv ({probe.stderr.decode()[-300:]}); {INSTALL_HINT}"

    procs: list[subprocess.Popen] = []
    tray_group = None
    daemon = start_daemon(tmp_path / "h", models_dir=tray_models_dir)
    try:
        xvfb, display = start_xvfb()
        procs.append(xvfb)
        env = dict(daemon.env, DISPLAY=display, PYSTRAY_BACKEND="gtk", NO_AT_BRIDGE="1")
        procs.append(subprocess.Popen(["trayer", "--edge", "top", "--align", "right", "--SetDockType", "true",
                                       "--widthtype", "request", "--height", str(PANEL_HEIGHT), "--transparent",
                                       "false", "--tint", "0x303030"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with daemon.client() as client:
            for _ in client.load("tiny", device="emulated", experts_dtype="int4"):
                pass
        tray_log = tmp_path / "tray.log"
        tray_cmd = Path(sys.executable).parent / "moed-tray"  # the console script (its name is the X class)
        assert tray_cmd.exists(), f"{tray_cmd} missing: reinstall the package (pip install -e .)"
        tray = subprocess.Popen(["dbus-run-session", "--", str(tray_cmd), "--socket", str(daemon.socket),
                                 "--log-level", "DEBUG"], env=env, stdout=open(tray_log, "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)  # killpg: bus and all
        procs.append(tray)
        tray_group = tray

        def log() -> str:
            return tray_log.read_text(errors="replace")[-3000:]

        # the icon's title is the menu's first line, so this also shows the live snapshot arrived
        icon = wait_for(lambda: tray.poll() is not None or docked_icon(env, "moed idle"), 30,
                        "the tray icon to dock showing 'moed idle'")
        assert tray.poll() is None, f"the tray exited: {log()}"
        mx, my, mw, mh = right_click(env, icon)
        time.sleep(0.3)  # let the menu finish drawing
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        left = max(0, mx - 12)
        subprocess.run(["import", "-window", "root", "-crop", f"{640 - left}x{my + mh + 12}+{left}+0", "+repage",
                        str(SCREENSHOT)], env=env, check=True, timeout=20)
        # keyboard: the first sensitive items are Models, VRAM cap, Pause serving
        xdotool(env, "key", "--delay", "100", "Down", "Down", "Down", "Return")
        with daemon.client() as client:
            wait_for(lambda: client.status().state == "paused", 10, lambda: f"the daemon to report paused; tray log: {log()}")
        # the menu follows the state: the item is now "Resume serving"
        wait_for(lambda: "Resume serving" in log(), 5, "the menu to offer Resume serving")
        wait_for(lambda: open_menu(env) is None, 5, "the menu to close")
        # Quit tray: Models, VRAM cap, Resume serving, Open logs, Quit tray
        right_click(env, icon)
        xdotool(env, "key", "--delay", "100", "Down", "Down", "Down", "Down", "Down", "Return")
        assert tray.wait(timeout=15) == 0, log()
        assert daemon.proc.poll() is None, "quitting the tray must leave the daemon running"
    finally:
        for proc in reversed(procs):
            if proc is tray_group:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # dbus-run-session, its bus and the tray
                except ProcessLookupError:
                    pass
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
        daemon.stop()
