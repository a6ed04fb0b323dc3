"""The tray icon: one distinct image per state, and a ring that grows with the expert cache's fill."""

from __future__ import annotations

import pytest
from PIL import ImageChops

from moed_tray import icon_art as art
from moed_tray.snapshot import Snapshot, not_running


def bright_ring_pixels(image) -> int:
    """Pixels of the ring's bright (filled) colour."""
    return sum(count for count, colour in image.getcolors(image.width * image.height) if colour == art.RING_FILL)


@pytest.mark.parametrize("size", [16, 22, 64])
def test_every_state_draws_a_distinct_rgba_icon(size):
    images = {state: art.draw_icon(state, 0.5, size) for state in art.ICON_STATES}
    for state, image in images.items():
        assert image.size == (size, size) and image.mode == "RGBA"
        assert image.getpixel((0, 0))[3] == 0, "corners stay transparent"
    states = list(images)
    for i, a in enumerate(states):
        for b in states[i + 1:]:
            diff = ImageChops.difference(images[a], images[b]).getbbox(alpha_only=False)
            assert diff is not None, f"{a} and {b} look the same"


def test_state_colour_is_in_the_middle():
    for state in (art.IDLE, art.GENERATING, art.LOADING, art.ERROR):
        image = art.draw_icon(state, 0.0, 64)
        # a point inside the disc but off the white marks
        assert image.getpixel((20, 44))[:3] == art.STATE_COLOURS[state], state


def test_ring_grows_with_cache_fill_and_is_empty_when_not_running():
    counts = [bright_ring_pixels(art.draw_icon(art.IDLE, fill, 64)) for fill in (0.0, 0.25, 0.5, 1.0)]
    assert counts[0] == 0
    assert counts[0] < counts[1] < counts[2] < counts[3]
    assert bright_ring_pixels(art.draw_icon(art.NOT_RUNNING, 1.0, 64)) == 0
    assert bright_ring_pixels(art.draw_icon(art.IDLE, 7.0, 64)) == counts[3], "fill is clamped to 1"


def test_unknown_state_is_refused():
    with pytest.raises(ValueError, match="icon state 'busy'"):
        art.draw_icon("busy")


def test_icon_state_from_snapshots():
    running = dict(running=True, address="a", loaded_names=("m",))
    assert art.icon_state(not_running("a")) == art.NOT_RUNNING
    assert art.icon_state(Snapshot(state="idle", **running)) == art.IDLE
    assert art.icon_state(Snapshot(state="generating", **running)) == art.GENERATING
    assert art.icon_state(Snapshot(state="loading", **running)) == art.LOADING
    assert art.icon_state(Snapshot(state="paused", **running)) == art.PAUSED
    assert art.icon_state(Snapshot(state="idle", **running), tray_error=True) == art.ERROR
    assert art.icon_state(Snapshot(running=True, address="a", problem="DEADLINE_EXCEEDED")) == art.ERROR
    # a failed load with nothing serving is an error; the same message while a model serves is history
    assert art.icon_state(Snapshot(running=True, address="a", state="idle", last_error="load failed")) == art.ERROR
    assert art.icon_state(Snapshot(state="idle", last_error="load failed", **running)) == art.IDLE


def test_icon_for_uses_the_snapshot_cache_fill():
    full = Snapshot(running=True, address="a", state="idle", loaded_names=("m",), budget_bytes=100, cache_bytes=100)
    empty = Snapshot(running=True, address="a", state="idle", loaded_names=("m",), budget_bytes=100, cache_bytes=0)
    assert bright_ring_pixels(art.icon_for(full)) > bright_ring_pixels(art.icon_for(empty)) == 0
