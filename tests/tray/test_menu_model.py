"""The tray menu as data, from hand-made snapshots of every daemon state (no display, no daemon)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from moed_tray import menu_model as m
from moed_tray.menu_model import MenuItem, build_menu
from moed_tray.snapshot import ModelEntry, Snapshot, not_running, snapshot_from
from moed.v1 import control_pb2

GB = 10**9
TRAY_DIR = Path(__file__).resolve().parents[2] / "tray"


def snap(**kw) -> Snapshot:
    base = dict(running=True, address="unix:///tmp/x.sock", state="idle",
                models=(ModelEntry("mixtral-8x7b", "/models/mixtral-8x7b", True),
                        ModelEntry("olmoe", "/models/olmoe", False)),
                loaded_names=("mixtral-8x7b",), tokens_per_second=12.34, has_gpu=True, vram_total=24 * GB,
                vram_ours=6 * GB, vram_other_apps=2 * GB, vram_free=16 * GB, budget_bytes=10 * GB, cap_bytes=0,
                cache_bytes=5 * GB)
    base.update(kw)
    return Snapshot(**base)


def by_text(items: list[MenuItem], prefix: str) -> MenuItem:
    found = [i for i in items if i.text.startswith(prefix)]
    assert len(found) == 1, f"expected one item starting {prefix!r} in {[i.text for i in items]}"
    return found[0]


def texts(items) -> list[str]:
    return [i.text for i in items if not i.is_separator]


def test_not_running_offers_start_and_hides_daemon_controls():
    items = build_menu(not_running("unix:///tmp/x.sock", "no moed daemon is answering"))
    assert items[0] == MenuItem(m.NOT_RUNNING_TEXT, enabled=False)
    assert by_text(items, "Start daemon").action == m.START_DAEMON
    assert by_text(items, "Quit tray").action == m.QUIT
    assert by_text(items, "Open logs").action == m.OPEN_LOGS
    for absent in ("Stop daemon", "Models", "VRAM cap", "Pause serving", "Resume serving"):
        assert not any(t.startswith(absent) for t in texts(items)), absent


def test_idle_status_lines_show_model_rate_and_vram_split():
    items = build_menu(snap())
    head, vram = items[0], items[1]
    assert not head.enabled and "idle" in head.text and "mixtral-8x7b" in head.text and "12.3 tok/s" in head.text
    assert not vram.enabled
    assert "ours 6.0 GB" in vram.text and "other apps 2.0 GB" in vram.text and "free 16.0 GB" in vram.text
    assert by_text(items, "Pause serving").action == m.PAUSE
    assert by_text(items, "Stop daemon").enabled
    assert not any(t.startswith("Start daemon") for t in texts(items))


def test_models_submenu_checks_loaded_and_clicks_load_or_unload():
    models = by_text(build_menu(snap()), "Models").submenu
    loaded, on_disk = models
    assert (loaded.text, loaded.checked, loaded.action, loaded.args) == ("mixtral-8x7b", True, m.UNLOAD, ("mixtral-8x7b",))
    assert (on_disk.text, on_disk.checked, on_disk.action, on_disk.args) == ("olmoe", False, m.LOAD, ("/models/olmoe",))
    assert loaded.enabled and on_disk.enabled


def test_loading_disables_model_clicks():
    items = build_menu(snap(state="loading"))
    assert "loading" in items[0].text
    assert all(not i.enabled for i in by_text(items, "Models").submenu)


def test_no_models_on_disk_says_so():
    models = by_text(build_menu(snap(models=(), loaded_names=())), "Models").submenu
    assert len(models) == 1 and not models[0].enabled and "no models" in models[0].text
    assert "no model loaded" in build_menu(snap(models=(), loaded_names=()))[0].text


def test_paused_offers_resume_instead_of_pause():
    items = build_menu(snap(state="paused"))
    assert by_text(items, "Resume serving").action == m.RESUME
    assert not any(t.startswith("Pause serving") for t in texts(items))


def test_generating_shows_the_rate():
    assert "generating" in build_menu(snap(state="generating", tokens_per_second=41.0))[0].text
    assert "41.0 tok/s" in build_menu(snap(state="generating", tokens_per_second=41.0))[0].text


def test_stopping_disables_stop():
    assert not by_text(build_menu(snap(state="stopping")), "Stop daemon").enabled


def test_cap_submenu_auto_presets_and_custom():
    auto = by_text(build_menu(snap()), "VRAM cap").submenu
    assert [i.text for i in auto] == ["Auto", "25%", "50%", "75%", "100%"]
    assert [i.checked for i in auto] == [True, False, False, False, False]
    assert [i.args for i in auto[1:]] == [(0.25,), (0.5,), (0.75,), (1.0,)]
    assert all(i.action == m.CAP_FRACTION and i.enabled for i in auto[1:])

    half = by_text(build_menu(snap(cap_bytes=12 * GB)), "VRAM cap").submenu
    assert [i.checked for i in half] == [False, False, True, False, False]

    custom = by_text(build_menu(snap(cap_bytes=7 * GB)), "VRAM cap").submenu
    assert custom[-1] == MenuItem("Custom: 7.0 GB", action=m.CAP_BYTES, args=(7 * GB,), checked=True)
    assert not any(i.checked for i in custom[:-1])


def test_without_gpu_readings_percent_caps_are_disabled():
    items = build_menu(snap(has_gpu=False, vram_total=0, vram_ours=0, vram_free=0, vram_other_apps=0))
    assert "no GPU memory readings" in items[1].text
    caps = by_text(items, "VRAM cap").submenu
    assert caps[0].enabled and not any(i.enabled for i in caps[1:5])


def test_last_error_is_shown():
    items = build_menu(snap(last_error="loading olmoe: not enough host RAM"))
    assert any(i.text == "last error: loading olmoe: not enough host RAM" and not i.enabled for i in items)


def test_daemon_answering_with_errors_keeps_stop_but_hides_controls():
    items = build_menu(Snapshot(running=True, address="x", problem="DEADLINE_EXCEEDED: busy"))
    assert "not answering" in items[0].text and "DEADLINE_EXCEEDED" in items[0].text
    assert by_text(items, "Stop daemon").enabled
    assert not any(t.startswith(("Models", "VRAM cap", "Pause", "Start daemon")) for t in texts(items))


def test_menu_items_are_frozen_values():
    a, b = build_menu(snap()), build_menu(snap())
    assert a == b and hash(tuple(a)) == hash(tuple(b))  # the app redraws only when the menu changed
    assert build_menu(snap(tokens_per_second=1.0)) != a
    with pytest.raises(AttributeError):
        a[0].text = "x"


def test_snapshot_from_protobuf_merges_disk_and_loaded_entries():
    status = control_pb2.Status(state="idle", tokens_per_second=3.5,
                                models=[control_pb2.ModelInfo(name="served", path="/m/tiny", loaded=True)],
                                memory=control_pb2.MemoryFigures(has_gpu=True, vram_total=8 * GB, vram_ours=GB,
                                                                 budget_bytes=4 * GB, cap_bytes=2 * GB),
                                engine=control_pb2.EngineFigures(cache_bytes=GB))
    listed = [control_pb2.ModelInfo(name="tiny", path="/m/tiny", loaded=False),
              control_pb2.ModelInfo(name="served", path="/m/tiny", loaded=True),
              control_pb2.ModelInfo(name="other", path="/m/other", loaded=False)]
    s = snapshot_from("addr", status, listed)
    assert s.models == (ModelEntry("other", "/m/other", False), ModelEntry("served", "/m/tiny", True))
    assert s.loaded_names == ("served",) and s.cap_bytes == 2 * GB and s.cache_fill == pytest.approx(0.25)
    assert not_running("addr").cache_fill == 0.0


def test_tray_imports_only_the_client_side_of_moed():
    allowed = {"moed.api.client", "moed.v1", "moed.service.paths", "moed.config", "moed.errors"}
    problems = []
    for file in TRAY_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("moed.") and not any(name == a or name.startswith(a + ".") for a in allowed):
                    problems.append(f"{file.name} imports {name}")
    assert not problems, problems


def test_importing_the_tray_loads_neither_torch_nor_the_engine_nor_pystray():
    code = ("import sys, moed_tray.app, moed_tray.actions, moed_tray.menu_model, moed_tray.icon_art, "
            "moed_tray.snapshot\n"
            "heavy = [n for n in ('torch', 'numba', 'moed.engine', 'moed.models', 'pystray') if n in sys.modules]\n"
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                            env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr


def test_models_from_other_stores_load_by_name_and_loads_in_flight_show_their_progress():
    status = control_pb2.Status(state="loading")
    listed = [control_pb2.ModelInfo(name="qwen3:30b-a3b", path="/home/u/.ollama/models/blobs/sha256-ab",
                                    source="ollama", state="on disk"),
              control_pb2.ModelInfo(name="mine", path="/m/mine", source="moed", state="on disk"),
              control_pb2.ModelInfo(name="org/repo:Q4_K_M", state="loading", load_fraction=0.42)]
    s = snapshot_from("addr", status, listed)
    assert [e.name for e in s.models] == ["mine", "qwen3:30b-a3b"] and s.loading == (("org/repo:Q4_K_M", 0.42),)
    assert "loading org/repo:Q4_K_M: 42%" in texts(build_menu(s))
    menu = by_text(build_menu(s.__class__(**{**s.__dict__, "state": "idle"})), "Models").submenu
    assert by_text(list(menu), "qwen3").args == ("qwen3:30b-a3b",)  # a name LoadModel resolves, not the blob
    assert by_text(list(menu), "mine").args == ("/m/mine",)
