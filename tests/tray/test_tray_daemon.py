"""The tray's menu model and actions against a real daemon on a temporary socket (no display needed)."""

from __future__ import annotations

import time

import pytest

from moed.api.client import MoedClient
from moed_tray import menu_model as m
from moed_tray.actions import TrayActions
from moed_tray.menu_model import build_menu
from moed_tray.snapshot import SnapshotSource, fetch_snapshot


def item(items, prefix: str):
    found = [i for i in items if i.text.startswith(prefix)]
    assert len(found) == 1, [i.text for i in items]
    return found[0]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def actions_for(daemon, tmp_path, **kw) -> TrayActions:
    return TrayActions(str(daemon.socket), log_dir=tmp_path / "logs", spawn_env=daemon.env, **kw)


def test_live_menu_and_actions_change_the_daemon(daemon, tmp_path):
    address = str(daemon.socket)
    actions = actions_for(daemon, tmp_path)
    menu = build_menu(fetch_snapshot(address))
    assert "idle" in menu[0].text and "no model loaded" in menu[0].text
    tiny = item(item(menu, "Models").submenu, "tiny")
    assert (tiny.checked, tiny.action) == (False, m.LOAD)

    # load: the click's action + args, exactly as the menu carries them
    result = actions.run(tiny.action, tiny.args)
    assert result.ok, result.message
    with daemon.client() as client:
        assert [x.name for x in client.status().models] == ["tiny"]
    menu = build_menu(fetch_snapshot(address))
    assert "tiny" in menu[0].text
    tiny = item(item(menu, "Models").submenu, "tiny")
    assert (tiny.checked, tiny.action, tiny.args) == (True, m.UNLOAD, ("tiny",))

    # VRAM cap: a preset, a custom value, back to auto
    half = item(item(menu, "VRAM cap").submenu, "50%")
    assert actions.run(half.action, half.args).ok
    with daemon.client() as client:
        total = client.status().memory.vram_total
        assert total and client.status().memory.cap_bytes == pytest.approx(total / 2, abs=1)
    caps = item(build_menu(fetch_snapshot(address)), "VRAM cap").submenu
    assert item(caps, "50%").checked and not item(caps, "Auto").checked
    assert actions.run(m.CAP_BYTES, (3 * 10**9,)).ok
    caps = item(build_menu(fetch_snapshot(address)), "VRAM cap").submenu
    assert item(caps, "Custom").checked and item(caps, "Custom").text == "Custom: 3.0 GB"
    assert actions.run(*(lambda i: (i.action, i.args))(item(caps, "Auto"))).ok
    with daemon.client() as client:
        assert client.status().memory.cap_bytes == 0

    # pause / resume
    assert actions.run(item(menu, "Pause serving").action).ok
    with daemon.client() as client:
        assert client.status().state == "paused"
    resume = item(build_menu(fetch_snapshot(address)), "Resume serving")
    assert actions.run(resume.action).ok
    with daemon.client() as client:
        assert client.status().state == "idle"

    # unload through the menu item
    assert actions.run(tiny.action, tiny.args).ok
    with daemon.client() as client:
        assert list(client.status().models) == []


def test_daemon_errors_come_back_as_messages(daemon, tmp_path):
    actions = actions_for(daemon, tmp_path)
    result = actions.run(m.UNLOAD, ("nope",))
    assert not result.ok and "'nope' is not loaded" in result.message
    result = actions.run(m.LOAD, (str(tmp_path / "missing-model"),))
    assert not result.ok and "missing-model" in result.message
    assert not actions.run("fly", ()).ok


def test_open_logs_creates_the_folder_and_opens_it(daemon, tmp_path):
    opened = []
    result = actions_for(daemon, tmp_path, opener=opened.append).run(m.OPEN_LOGS)
    assert result.ok and opened == [tmp_path / "logs"] and opened[0].is_dir()


def test_stopped_daemon_shows_not_running_and_start_brings_one_up_on_the_same_socket(daemon, tmp_path):
    address = str(daemon.socket)
    source = SnapshotSource(address)
    assert source.fetch().running
    assert daemon.stop() == 0

    snapshot = source.fetch()  # the same source: it must notice the daemon went away
    assert not snapshot.running and "no moed daemon" in snapshot.problem
    menu = build_menu(snapshot)
    assert menu[0].text == m.NOT_RUNNING_TEXT
    actions = actions_for(daemon, tmp_path)
    paused = actions.run(m.PAUSE)
    assert not paused.ok and "Start daemon" in paused.message

    start = item(menu, "Start daemon")
    try:
        result = actions.run(start.action, start.args)
        assert result.ok, result.message
        with MoedClient(address, timeout=5) as client:
            assert client.status().state == "idle"
        snapshot = source.fetch()  # and the same source sees the new daemon at once
        assert snapshot.running and "idle" in build_menu(snapshot)[0].text
        again = actions.run(m.START_DAEMON)
        assert again.ok and "already running" in again.message
    finally:
        stop = actions.run(m.STOP_DAEMON)
    assert stop.ok, stop.message
    wait_for(lambda: not source.fetch().running, 30, "the started daemon to stop")
    source.close()
