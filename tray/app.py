"""The tray app: a pystray icon whose menu and image follow the daemon's status (a pure gRPC client).

Threads: pystray's loop owns the main thread (`Icon.run()`); a refresh thread fetches a Snapshot about
every second and pushes a new menu/icon only when they changed; each clicked action runs on its own
worker thread, so a busy or vanished daemon never freezes the menu.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import threading
from pathlib import Path

from moed_tray import menu_model
from moed_tray.actions import ActionResult, TrayActions
from moed_tray.icon_art import icon_for, icon_state
from moed_tray.menu_model import MenuItem, build_menu
from moed_tray.snapshot import Snapshot, SnapshotSource, not_running

log = logging.getLogger("moed.tray")

REFRESH_S = 1.0


def default_address() -> str:
    """$MOED_SOCKET, else the daemon's default address (moed.service.paths imports nothing heavy)."""
    from moed import config
    from moed.service import paths

    return config.socket_override() or paths.default_address()


def default_log_dir() -> Path:
    from moed.service import paths

    return paths.log_dir()


def _const(value):
    return lambda _item: value


class TrayApp:
    def __init__(self, address: str, *, log_dir: Path, token: str | None = None, refresh_s: float = REFRESH_S,
                 spawn_env: dict | None = None) -> None:
        self.address = address
        self.refresh_s = refresh_s
        self.source = SnapshotSource(address, token=token)
        self.actions = TrayActions(address, log_dir=log_dir, token=token, spawn_env=spawn_env)
        self.snapshot: Snapshot = not_running(address)
        self.tray_error = False  # the last action failed; the icon shows it until an action succeeds
        self.icon = None
        self._shown_menu: list[MenuItem] | None = None
        self._shown_icon: tuple | None = None
        self._stopping = threading.Event()
        self._refresh_now = threading.Event()

    # -- main thread ------------------------------------------------------------------------------
    def run(self) -> None:
        import pystray  # lazily: it raises at import without a display

        self._pystray = pystray
        self.icon = pystray.Icon("moed", icon=icon_for(self.snapshot), title="moed",
                                 menu=self._to_pystray(build_menu(self.snapshot)))
        try:
            self.icon.run(setup=self._setup)
        except Exception as exc:  # GLib complains about org.freedesktop.Notifications without a notifier
            log.debug("tray loop ended with %s", exc)
        finally:
            self._stopping.set()
            self.source.close()

    def _setup(self, icon) -> None:
        icon.visible = True
        threading.Thread(target=self._refresh_loop, daemon=True, name="moed-tray-refresh").start()

    # -- refresh thread ---------------------------------------------------------------------------
    def _refresh_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.apply(self.source.fetch())
            except Exception:  # never let the refresh thread die
                log.exception("tray refresh failed")
            self._refresh_now.wait(self.refresh_s)
            self._refresh_now.clear()

    def apply(self, snapshot: Snapshot) -> None:
        """Show a snapshot: swap the menu and image only when they changed (an open menu stays put)."""
        self.snapshot = snapshot
        items = build_menu(snapshot)
        if items != self._shown_menu:
            self._shown_menu = items
            self.icon.menu = self._to_pystray(items)  # the setter calls update_menu()
            self.icon.title = items[0].text
            log.debug("menu now: %s", " | ".join(i.text for i in items if not i.is_separator))
        key = (icon_state(snapshot, tray_error=self.tray_error), round(snapshot.cache_fill * 24))
        if key != self._shown_icon:
            self._shown_icon = key
            self.icon.icon = icon_for(snapshot, tray_error=self.tray_error)

    def _to_pystray(self, items: list[MenuItem]):
        pystray = self._pystray
        out = []
        for item in items:
            if item.is_separator:
                out.append(pystray.Menu.SEPARATOR)
            elif item.submenu:
                out.append(pystray.MenuItem(item.text, pystray.Menu(*self._to_pystray(list(item.submenu))),
                                            enabled=item.enabled))
            else:
                action = functools.partial(self._on_click, item.action, item.args) if item.action else None
                out.append(pystray.MenuItem(item.text, action, enabled=item.enabled and item.action is not None,
                                            checked=None if item.checked is None else _const(item.checked)))
        return pystray.Menu(*out)

    # -- clicks (GTK thread) and their workers ------------------------------------------------------
    def _on_click(self, action: str, args: tuple, _icon=None, _item=None) -> None:
        log.info("menu: %s %s", action, args)
        if action == menu_model.QUIT:
            self.quit()
            return
        threading.Thread(target=self._run_action, args=(action, args), daemon=True, name=f"moed-tray-{action}").start()

    def _run_action(self, action: str, args: tuple) -> None:
        result: ActionResult = self.actions.run(action, args)
        log.info("action %s: %s", action, result.message)
        self.tray_error = not result.ok
        if not result.ok:
            self.notify(result.message)
        self._refresh_now.set()

    def notify(self, message: str) -> None:
        print(f"moed-tray: {message}", file=sys.stderr, flush=True)
        try:
            self.icon.notify(message, "moed")
        except Exception as exc:  # no notification daemon (GLib error): the message is on stderr already
            log.debug("notification not shown: %s", exc)

    def quit(self) -> None:
        self._stopping.set()
        self._refresh_now.set()
        try:
            self.icon.stop()
        except Exception as exc:  # GLib error about org.freedesktop.Notifications when no notifier runs
            log.debug("icon.stop: %s", exc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moed-tray", description="Tray icon and menu for the moed daemon.")
    parser.add_argument("--socket", metavar="PATH", help="daemon address (default $MOED_SOCKET, else the "
                        "user's runtime directory)")
    parser.add_argument("--refresh", type=float, default=REFRESH_S, help="seconds between status refreshes")
    parser.add_argument("--log-level", default="WARNING")
    return parser


def has_display(platform: str = sys.platform, env: dict | None = None) -> bool:
    env = os.environ if env is None else env
    if platform.startswith("win") or platform == "darwin":
        return True
    return bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="moed-tray %(levelname)s %(message)s")
    log.setLevel(args.log_level.upper())  # only the tray's own logger: PIL and GTK stay quiet
    if not has_display():
        print("moed-tray: error: no desktop session (DISPLAY / WAYLAND_DISPLAY unset); the tray needs one",
              file=sys.stderr)
        return 2
    from moed import config
    from moed.errors import MoedError

    try:
        address = args.socket or default_address()
        token = config.daemon_token()  # a bad $MOED_TOKEN_FILE is a one-line error, not a traceback
    except MoedError as exc:
        print(f"moed-tray: error: {exc}", file=sys.stderr)
        return 2
    app = TrayApp(address, log_dir=default_log_dir(), token=token, refresh_s=args.refresh)
    try:
        app.run()
    except ImportError as exc:
        print(f"moed-tray: error: cannot load the tray library ({exc}); on Linux install the GTK bindings "
              "(python3-gi, gir1.2-gtk-3.0) and `pip install 'moed[gui]'`", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        app.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
