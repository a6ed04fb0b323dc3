"""Memory governor: budget math, immediate shrink, hysteresis on grow, sources, host RAM check."""

from __future__ import annotations

import json
import threading
import time

import pytest

from moed.errors import InsufficientMemoryError, InvalidRequestError, MoedError
from moed.service.memory_governor import GovernorConfig, MemoryGovernor, check_host_ram, plan_cache_bytes
from moed.service.memory_source import (FileSource, MemoryReading, NoGpuSource, NvmlSource, SimulatedSource,
                                        default_memory_source)

MiB = 1 << 20
GiB = 1 << 30


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(total=24 * GiB, others=0, cap=None, **cfg):
    source = SimulatedSource(total, others)
    clock = FakeClock()
    config = GovernorConfig(**{"headroom_bytes": 512 * MiB, "grow_hysteresis_bytes": 256 * MiB,
                               "grow_hysteresis_fraction": 0.0, "grow_after_s": 3.0, **cfg})
    gov = MemoryGovernor(source, config, user_cap_bytes=cap, clock=clock)
    seen = []
    gov.on_budget(seen.append)
    return gov, source, clock, seen


# --- budget math --------------------------------------------------------------------------------

def test_budget_is_total_minus_others_minus_headroom():
    gov, _, _, _ = make(total=24 * GiB, others=3 * GiB)
    assert gov.budget() == 24 * GiB - 3 * GiB - 512 * MiB


def test_user_cap_limits_the_budget_and_the_smaller_wins():
    gov, _, _, _ = make(total=24 * GiB, others=3 * GiB, cap=8 * GiB)
    assert gov.budget() == 8 * GiB
    gov.set_user_cap(30 * GiB)  # a cap above what is free does not create memory
    assert gov.budget() == 24 * GiB - 3 * GiB - 512 * MiB
    gov.set_user_cap(fraction=0.25)
    assert gov.budget() == 6 * GiB
    gov.set_user_cap(None)
    assert gov.budget() == 24 * GiB - 3 * GiB - 512 * MiB


def test_headroom_fraction_applies_when_larger_than_bytes():
    gov, _, _, _ = make(total=100 * GiB, headroom_fraction=0.1)
    assert gov.budget() == 90 * GiB


def test_user_cap_changes_apply_at_once_and_notify():
    gov, _, _, seen = make(total=24 * GiB)
    gov.poll_once()
    gov.set_user_cap(4 * GiB)
    gov.set_user_cap(6 * GiB)  # raising the cap needs no hysteresis wait
    assert seen == [4 * GiB, 6 * GiB]
    assert gov.figures()["cap_bytes"] == 6 * GiB


def test_without_gpu_the_budget_is_the_user_cap_or_unlimited():
    gov = MemoryGovernor(NoGpuSource())
    assert gov.budget() is None
    gov.set_user_cap(2 * GiB)
    assert gov.budget() == 2 * GiB
    figures = gov.figures()
    assert figures["has_gpu"] is False and figures["source"] == "cap"
    gov.set_user_cap(fraction=0.5)  # a share of no GPU is no cap
    assert gov.budget() is None


def test_budget_never_negative_when_others_take_everything():
    gov, _, _, _ = make(total=8 * GiB, others=8 * GiB)
    assert gov.budget() == 0


def test_invalid_settings_are_refused_with_the_value():
    with pytest.raises(InvalidRequestError, match="-1"):
        GovernorConfig(headroom_bytes=-1)
    with pytest.raises(InvalidRequestError, match="1.5"):
        MemoryGovernor(NoGpuSource()).set_user_cap(fraction=1.5)


# --- shrink now, grow after hysteresis ----------------------------------------------------------

def test_shrink_is_immediate_when_another_app_grabs_memory():
    gov, source, _, seen = make(total=24 * GiB)
    start = gov.budget()
    source.set_other_apps(6 * GiB)
    gov.poll_once()  # no time passes
    assert gov.budget() == start - 6 * GiB
    assert seen == [start - 6 * GiB]
    assert gov.figures()["num_shrinks"] == 1


def test_grow_waits_for_time_and_margin():
    gov, source, clock, seen = make(total=24 * GiB, others=6 * GiB)
    low = gov.budget()
    source.set_other_apps(0)
    gov.poll_once()
    clock.advance(2.9)
    gov.poll_once()
    assert gov.budget() == low and seen == []  # not long enough yet
    clock.advance(0.2)
    gov.poll_once()
    assert gov.budget() == low + 6 * GiB
    assert seen == [low + 6 * GiB]
    assert gov.figures()["num_grows"] == 1


def test_grow_below_the_margin_never_happens():
    gov, source, clock, seen = make(total=24 * GiB, others=1 * GiB)
    low = gov.budget()
    source.set_other_apps(1 * GiB - 200 * MiB)  # 200 MiB more room < 256 MiB margin
    for _ in range(20):
        clock.advance(1.0)
        gov.poll_once()
    assert gov.budget() == low and seen == []


def test_grow_restarts_when_the_budget_dips_back_and_takes_the_lowest_value_seen():
    gov, source, clock, seen = make(total=24 * GiB, others=6 * GiB)
    low = gov.budget()
    source.set_other_apps(0)
    gov.poll_once()
    clock.advance(2.0)
    source.set_other_apps(6 * GiB)  # the app is back: the pending grow starts over
    gov.poll_once()
    source.set_other_apps(0)
    clock.advance(2.0)
    gov.poll_once()
    assert gov.budget() == low and seen == []
    source.set_other_apps(2 * GiB)  # still well above the margin, but lower
    clock.advance(1.5)
    gov.poll_once()
    source.set_other_apps(0)
    clock.advance(1.6)
    gov.poll_once()
    assert seen == [low + 4 * GiB]  # the lowest budget of the window, not the last


def test_small_drops_are_absorbed_by_the_headroom():
    gov, source, _, seen = make(total=24 * GiB, shrink_tolerance_bytes=32 * MiB)
    start = gov.budget()
    source.set_other_apps(16 * MiB)
    gov.poll_once()
    assert gov.budget() == start and seen == []
    source.set_other_apps(64 * MiB)
    gov.poll_once()
    assert seen == [start - 64 * MiB]


def test_repeated_grab_and_release_does_not_thrash():
    gov, source, clock, seen = make(total=24 * GiB)
    start = gov.budget()
    for _ in range(30):  # an app grabbing 4 GiB for 1 s, releasing for 1 s
        source.set_other_apps(4 * GiB)
        for _ in range(2):
            clock.advance(0.5)
            gov.poll_once()
        source.set_other_apps(0)
        for _ in range(2):
            clock.advance(0.5)
            gov.poll_once()
    assert seen == [start - 4 * GiB]  # one shrink, no grow-shrink cycles
    source.set_other_apps(0)
    for _ in range(8):
        clock.advance(0.5)
        gov.poll_once()
    assert seen == [start - 4 * GiB, start]  # once the app is really gone, one grow


def test_governor_thread_reacts_in_real_time():
    source = SimulatedSource(16 * GiB)
    config = GovernorConfig(poll_interval_s=0.01, grow_after_s=0.2, grow_hysteresis_fraction=0.0)
    events = []
    changed = threading.Event()

    def on_budget(value):
        events.append((threading.current_thread().name, value))
        changed.set()

    with MemoryGovernor(source, config) as gov:
        gov.on_budget(on_budget)
        start = gov.budget()
        source.set_other_apps(2 * GiB)
        assert changed.wait(10.0)
        assert events == [("moed-memory-governor", start - 2 * GiB)]
        changed.clear()
        t0 = time.monotonic()
        source.set_other_apps(0)
        assert changed.wait(10.0)
        assert time.monotonic() - t0 >= 0.2
        assert events[-1] == ("moed-memory-governor", start)


def test_a_failing_source_keeps_the_last_budget_and_a_failing_callback_is_contained():
    class Flaky:
        def __init__(self):
            self.fail = False
            self.inner = SimulatedSource(8 * GiB)

        def read(self, ours_hint=0):
            if self.fail:
                raise RuntimeError("GPU is lost")
            return self.inner.read(ours_hint)

    source = Flaky()
    gov = MemoryGovernor(source, GovernorConfig())
    start = gov.budget()
    source.fail = True
    gov.poll_once()
    assert gov.budget() == start
    source.fail = False
    gov.on_budget(lambda value: 1 / 0)
    seen = []
    gov.on_budget(seen.append)
    source.inner.set_other_apps(1 * GiB)
    gov.poll_once()
    assert seen == [start - 1 * GiB]


def test_set_ours_reaches_the_source_and_the_figures():
    gov, _, _, _ = make(total=24 * GiB, others=2 * GiB)
    gov.set_ours(5 * GiB)
    gov.poll_once()
    figures = gov.figures()
    assert figures["vram_ours"] == 5 * GiB
    assert figures["vram_free"] == 24 * GiB - 2 * GiB - 5 * GiB
    assert figures["vram_other_apps"] == 2 * GiB
    assert figures["budget_bytes"] == 24 * GiB - 2 * GiB - 512 * MiB  # what we hold is ours to keep
    assert figures["source"] == "simulated"
    assert figures["host_total"] > 0


# --- sources ------------------------------------------------------------------------------------

def test_file_source_follows_the_file_and_survives_partial_writes(tmp_path):
    path = tmp_path / "gpu.json"
    source = FileSource(path)
    assert source.read().total == 0  # no file yet: no GPU
    path.write_text(json.dumps({"total": 16 * GiB, "other_apps": 1 * GiB}))
    assert source.read(ours_hint=2 * GiB) == MemoryReading(16 * GiB, 13 * GiB, 1 * GiB, 2 * GiB, "simulated")
    good = source.read()
    for bad in ('{"total": 17179869184, "other_a', "", "[]", '{"total": "lots"}', '{"total": -1}'):
        path.write_text(bad)
        assert source.read() == good
    path.unlink()
    assert source.read() == good
    path.write_text(json.dumps({"total": 16 * GiB, "other_apps": 5 * GiB}))
    assert source.read().used_by_others == 5 * GiB


def test_file_source_drives_a_governor(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"total": 16 * GiB, "other_apps": 0}))
    clock = FakeClock()
    gov = MemoryGovernor(FileSource(path), GovernorConfig(grow_hysteresis_fraction=0.0), clock=clock)
    start = gov.budget()
    path.write_text(json.dumps({"total": 16 * GiB, "other_apps": 3 * GiB}))
    gov.poll_once()
    assert gov.budget() == start - 3 * GiB
    path.write_text("{")  # mid-write
    gov.poll_once()
    assert gov.budget() == start - 3 * GiB


def test_nvml_is_unavailable_here_and_nothing_raises(tmp_path):
    pytest.importorskip("pynvml")
    if NvmlSource.available():
        pytest.skip("this machine has an NVIDIA driver")
    assert NvmlSource.available(3) is False
    source = default_memory_source()
    assert isinstance(source, NoGpuSource)
    assert source.read().total == 0
    assert isinstance(default_memory_source(gpu_memory_file=tmp_path / "g.json"), FileSource)


def test_nvml_attribution_falls_back_to_total_minus_free(monkeypatch):
    """NvmlSource's arithmetic with a stand-in pynvml (no driver here)."""
    import types

    class Proc:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used

    procs = {"compute": [], "graphics": []}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: "h",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=24 * GiB, free=14 * GiB),
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs["compute"],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: procs["graphics"],
    )
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    source = NvmlSource(0, our_pids=(111,))
    # our pid listed: ours from NVML, everything else used is others'
    procs["compute"] = [Proc(111, 4 * GiB), Proc(222, 5 * GiB)]
    procs["graphics"] = [Proc(333, 1 * GiB)]
    reading = source.read(ours_hint=1 * GiB)
    assert (reading.used_by_us, reading.used_by_others, reading.source) == (4 * GiB, 6 * GiB, "nvml")
    # usedGpuMemory unknown (None) or our pid not visible (container): use what the daemon says it holds
    procs["compute"] = [Proc(111, None), Proc(222, None)]
    procs["graphics"] = []
    reading = source.read(ours_hint=3 * GiB)
    assert (reading.used_by_us, reading.used_by_others) == (3 * GiB, 7 * GiB)


# --- plan_cache_bytes and host RAM --------------------------------------------------------------

def test_plan_cache_bytes_subtracts_fixed_kv_and_reserve():
    assert plan_cache_bytes(10 * GiB, 2 * GiB, 1 * GiB, reserve_bytes=512 * MiB) == 6 * GiB + 512 * MiB


def test_plan_cache_bytes_rounds_to_whole_experts_and_clamps():
    slot = 300 * MiB
    got = plan_cache_bytes(10 * GiB, 2 * GiB, 1 * GiB, slot_bytes=slot)
    assert got == (7 * GiB // slot) * slot and got % slot == 0 and 7 * GiB - got < slot
    assert plan_cache_bytes(10 * GiB, 2 * GiB, 1 * GiB, max_cache_bytes=3 * GiB) == 3 * GiB
    assert plan_cache_bytes(2 * GiB, 2 * GiB, 1 * GiB) == 0  # KV and weights already exceed it
    assert plan_cache_bytes(2 * GiB, 2 * GiB, 1 * GiB, min_cache_bytes=256 * MiB) == 256 * MiB
    assert plan_cache_bytes(None, 2 * GiB, 1 * GiB, max_cache_bytes=40 * GiB) == 40 * GiB
    with pytest.raises(ValueError, match="max_cache_bytes"):
        plan_cache_bytes(None, 0, 0)
    with pytest.raises(ValueError, match="kv_bytes"):
        plan_cache_bytes(GiB, 0, -1)


def test_check_host_ram_message_says_how_much_and_what_to_do():
    check_host_ram(1 * 10**9, available_bytes=2 * 10**9)
    with pytest.raises(InsufficientMemoryError) as info:
        check_host_ram(12_300_000_000, available_bytes=8_100_000_000)
    assert isinstance(info.value, MoedError)
    assert str(info.value) == ("the model needs 12.3 GB of host RAM but 8.1 GB are available; "
                               "close other programs or use a smaller expert dtype (--experts-dtype int4)")


def test_check_host_ram_uses_psutil_available():
    import psutil

    available = psutil.virtual_memory().available
    check_host_ram(1024)
    with pytest.raises(InsufficientMemoryError, match="of host RAM"):
        check_host_ram(available * 4)
