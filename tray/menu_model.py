"""The tray menu as data: a pure function from a daemon Snapshot to a list of MenuItems (no GUI here)."""

from __future__ import annotations

from dataclasses import dataclass

from moed_tray.snapshot import Snapshot

# action ids (moed_tray.actions maps each to an RPC or a local step)
LOAD = "load"  # args: (model path,)
UNLOAD = "unload"  # args: (served name,)
CAP_AUTO = "cap_auto"  # args: ()
CAP_FRACTION = "cap_fraction"  # args: (fraction of total VRAM,)
CAP_BYTES = "cap_bytes"  # args: (bytes,)
PAUSE = "pause"
RESUME = "resume"
OPEN_LOGS = "open_logs"
START_DAEMON = "start_daemon"
STOP_DAEMON = "stop_daemon"
QUIT = "quit"

CAP_PRESETS = (0.25, 0.50, 0.75, 1.00)
NOT_RUNNING_TEXT = "moed: daemon not running"


@dataclass(frozen=True)
class MenuItem:
    text: str
    action: str | None = None  # None: a label (or a submenu holder)
    args: tuple = ()
    checked: bool | None = None  # None: not a check item
    enabled: bool = True
    submenu: tuple["MenuItem", ...] = ()
    is_separator: bool = False


SEPARATOR = MenuItem(text="", enabled=False, is_separator=True)


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def status_lines(s: Snapshot) -> tuple[MenuItem, ...]:
    """Disabled label lines: state, model, tok/s; VRAM ours / other apps / free; the last error."""
    if s.problem:
        head = f"moed: daemon not answering ({s.problem[:80]})"
        return (MenuItem(head, enabled=False),)
    models = ", ".join(s.loaded_names) if s.loaded_names else "no model loaded"
    lines = [MenuItem(f"moed {s.state or 'unknown'} · {models} · {s.tokens_per_second:.1f} tok/s", enabled=False)]
    for name, fraction in s.loading:
        lines.append(MenuItem(f"loading {name}: {fraction:.0%}", enabled=False))
    if s.has_gpu:
        lines.append(MenuItem(f"VRAM: ours {gb(s.vram_ours)} · other apps {gb(s.vram_other_apps)} · "
                              f"free {gb(s.vram_free)}", enabled=False))
    else:
        lines.append(MenuItem("VRAM: no GPU memory readings", enabled=False))
    if s.last_error:
        lines.append(MenuItem(f"last error: {s.last_error[:100]}", enabled=False))
    return tuple(lines)


def models_submenu(s: Snapshot) -> MenuItem:
    items = tuple(
        MenuItem(m.name, action=UNLOAD if m.is_loaded else LOAD, args=(m.name,) if m.is_loaded else (m.load_arg,),
                 checked=m.is_loaded, enabled=s.state != "loading")
        for m in s.models)
    if not items:
        items = (MenuItem("no models found in the model directories", enabled=False),)
    return MenuItem("Models", submenu=items)


def _preset_matching(s: Snapshot) -> float | None:
    """The preset fraction the current cap equals (within 1% of total VRAM), if any."""
    if not s.cap_bytes or not s.vram_total:
        return None
    for fraction in CAP_PRESETS:
        if abs(s.cap_bytes - fraction * s.vram_total) <= 0.01 * s.vram_total:
            return fraction
    return None


def cap_submenu(s: Snapshot) -> MenuItem:
    preset = _preset_matching(s)
    # a fraction needs the GPU's total; without one the daemon refuses percentage caps
    can_fraction = s.has_gpu and s.vram_total > 0
    items = [MenuItem("Auto", action=CAP_AUTO, checked=s.cap_bytes == 0)]
    items += [MenuItem(f"{round(f * 100)}%", action=CAP_FRACTION, args=(f,), checked=preset == f, enabled=can_fraction)
              for f in CAP_PRESETS]
    if s.cap_bytes and preset is None:
        items.append(MenuItem(f"Custom: {gb(s.cap_bytes)}", action=CAP_BYTES, args=(s.cap_bytes,), checked=True))
    return MenuItem("VRAM cap", submenu=tuple(items))


def build_menu(s: Snapshot) -> list[MenuItem]:
    """The whole tray menu for one snapshot, top to bottom."""
    if not s.running:
        return [MenuItem(NOT_RUNNING_TEXT, enabled=False), SEPARATOR,
                MenuItem("Start daemon", action=START_DAEMON), MenuItem("Open logs", action=OPEN_LOGS),
                SEPARATOR, MenuItem("Quit tray", action=QUIT)]
    items = list(status_lines(s))
    items.append(SEPARATOR)
    if not s.problem:
        items += [models_submenu(s), cap_submenu(s),
                  MenuItem("Resume serving", action=RESUME) if s.is_paused else MenuItem("Pause serving", action=PAUSE)]
    items += [MenuItem("Open logs", action=OPEN_LOGS), SEPARATOR, MenuItem("Quit tray", action=QUIT),
              MenuItem("Stop daemon", action=STOP_DAEMON, enabled=s.state != "stopping")]
    return items
