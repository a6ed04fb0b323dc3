"""The tray icon, drawn with pillow: a disc coloured by daemon state inside a ring showing expert-cache fill."""

from __future__ import annotations

from PIL import Image, ImageDraw

from moed_tray.snapshot import Snapshot

IDLE, GENERATING, LOADING, PAUSED, ERROR, NOT_RUNNING = "idle", "generating", "loading", "paused", "error", "not_running"
ICON_STATES = (IDLE, GENERATING, LOADING, PAUSED, ERROR, NOT_RUNNING)

# RGB per state: the disc in the middle
STATE_COLOURS = {
    IDLE: (46, 160, 67),  # green
    GENERATING: (31, 111, 235),  # blue
    LOADING: (219, 171, 9),  # amber
    PAUSED: (130, 130, 140),  # grey
    ERROR: (207, 34, 46),  # red
    NOT_RUNNING: (90, 90, 90),  # dark grey, hollow
}
RING_TRACK = (60, 60, 60, 255)
RING_FILL = (240, 240, 240, 255)


def icon_state(snapshot: Snapshot, *, tray_error: bool = False) -> str:
    """The icon state for a snapshot. `tray_error`: the tray's last action failed (shown until the next success)."""
    if not snapshot.running:
        return NOT_RUNNING
    if tray_error or snapshot.problem:
        return ERROR
    if snapshot.state == "loading":
        return LOADING
    if snapshot.state == "generating":
        return GENERATING
    if snapshot.state in ("paused", "stopping"):
        return PAUSED
    if snapshot.last_error and not snapshot.loaded_names:
        return ERROR  # the last load failed and nothing is serving
    return IDLE


def draw_icon(state: str, cache_fill: float = 0.0, size: int = 64) -> Image.Image:
    """An RGBA square icon: a ring whose bright arc (clockwise from 12 o'clock) is the cache fill, and a disc
    in the state's colour; generating adds a white 'play' mark, loading an hourglass bar, error a '!'."""
    if state not in STATE_COLOURS:
        raise ValueError(f"icon state {state!r} is not one of {', '.join(ICON_STATES)}")
    fill = max(0.0, min(1.0, float(cache_fill)))
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    ring = max(2, size // 9)
    box = (1, 1, size - 2, size - 2)
    draw.ellipse(box, outline=RING_TRACK, width=ring)
    if state != NOT_RUNNING and fill > 0:
        draw.arc(box, start=-90, end=-90 + 360 * fill, fill=RING_FILL, width=ring)
    inner = ring + max(2, size // 16)
    disc = (inner, inner, size - 1 - inner, size - 1 - inner)
    colour = STATE_COLOURS[state] + (255,)
    if state == NOT_RUNNING:
        draw.ellipse(disc, outline=colour, width=max(2, size // 12))
        return image
    draw.ellipse(disc, fill=colour)
    c, r = size / 2, (size - 2 * inner) / 2
    white = (255, 255, 255, 255)
    if state == GENERATING:
        draw.polygon([(c - r * 0.35, c - r * 0.5), (c - r * 0.35, c + r * 0.5), (c + r * 0.55, c)], fill=white)
    elif state == LOADING:
        draw.rectangle((c - r * 0.5, c - r * 0.15, c + r * 0.5, c + r * 0.15), fill=white)
    elif state == PAUSED:
        draw.rectangle((c - r * 0.4, c - r * 0.45, c - r * 0.12, c + r * 0.45), fill=white)
        draw.rectangle((c + r * 0.12, c - r * 0.45, c + r * 0.4, c + r * 0.45), fill=white)
    elif state == ERROR:
        draw.rectangle((c - r * 0.12, c - r * 0.55, c + r * 0.12, c + r * 0.15), fill=white)
        draw.rectangle((c - r * 0.12, c + r * 0.3, c + r * 0.12, c + r * 0.55), fill=white)
    return image


def icon_for(snapshot: Snapshot, *, tray_error: bool = False, size: int = 64) -> Image.Image:
    return draw_icon(icon_state(snapshot, tray_error=tray_error), snapshot.cache_fill, size)
