"""EmulatedDevice: slot memory, row copies (correctness, pacing, handles, threads), move/resize, compute charging."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moed.devices import DeviceMemoryError, EmulatedDevice, slot_layout, slot_nbytes

MB = 1_000_000


def _bank(num_rows: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    """Bank-like tensors of three dtypes, indexed by flat id on dim 0, every row distinct."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "gate_up": torch.randn(num_rows, 8, 6, generator=gen),
        "down.scale": torch.randn(num_rows, 2, 6, generator=gen).to(torch.bfloat16),
        "down.q": torch.randint(0, 256, (num_rows, 64, 3), generator=gen, dtype=torch.uint8),
    }


def _big_bank(nbytes: int, num_rows: int = 4) -> dict[str, torch.Tensor]:
    return {"w": torch.randint(0, 256, (num_rows, nbytes // num_rows), dtype=torch.uint8)}


def test_alloc_slots_shapes_and_capacity() -> None:
    bank = _bank()
    layout = slot_layout(bank)
    per_slot = slot_nbytes(layout)
    assert per_slot == sum(t[0].numel() * t.element_size() for t in bank.values())
    dev = EmulatedDevice(b_p=1e9, b_dev=1e12, capacity_bytes=5 * per_slot)
    slots = dev.alloc_slots(3, layout)
    assert {k: (tuple(t.shape), t.dtype) for k, t in slots.items()} == {
        k: ((3, *t.shape[1:]), t.dtype) for k, t in bank.items()
    }
    assert dev.info().kind == "emulated" and dev.info().free_bytes == 2 * per_slot
    with pytest.raises(DeviceMemoryError, match="capacity_bytes"):
        dev.alloc_slots(3, layout)
    assert dev.info().free_bytes == 2 * per_slot  # a failed alloc leaves nothing behind
    dev.free_slots(slots)
    assert slots == {} and dev.info().free_bytes == 5 * per_slot


def test_dropped_storage_returns_capacity() -> None:
    layout = slot_layout(_bank())
    dev = EmulatedDevice(capacity_bytes=4 * slot_nbytes(layout))
    slots = dev.alloc_slots(4, layout)
    del slots
    assert dev.info().free_bytes == dev.info().total_bytes
    dev.alloc_slots(4, layout)  # would not fit if the dropped storage were still counted


def test_copy_rows_land_in_the_right_slots_for_every_kind() -> None:
    bank = _bank()
    dev = EmulatedDevice(b_p=float("inf"))
    slots = dev.alloc_slots(6, slot_layout(bank))
    for t in slots.values():
        t.zero_()
    dst, src = [0, 3, 1, 2, 5], [5, 2, 7, 8, 0]  # (1, 2) <- (7, 8) is one contiguous run
    handle = dev.copy_rows_async(slots, dst, bank, src)
    handle.wait()
    assert handle.done()
    for kind, t in slots.items():
        for d, s in zip(dst, src):
            assert torch.equal(t[d], bank[kind][s]), (kind, d, s)
        assert not t[4].any(), f"{kind}: slot 4 was not a destination but changed"
    assert handle.nbytes == 5 * slot_nbytes(slot_layout(bank))
    assert dev.stats().bytes_copied == handle.nbytes and dev.stats().num_copies == 1


def test_copy_rejects_bad_requests() -> None:
    bank = _bank()
    dev = EmulatedDevice()
    slots = dev.alloc_slots(4, slot_layout(bank))
    with pytest.raises(ValueError, match="out of range"):
        dev.copy_rows_async(slots, [4], bank, [0])
    with pytest.raises(ValueError, match="out of range"):
        dev.copy_rows_async(slots, [0], bank, [10])
    with pytest.raises(ValueError, match="repeats"):
        dev.copy_rows_async(slots, [1, 1], bank, [0, 2])
    with pytest.raises(ValueError, match="entries"):
        dev.copy_rows_async(slots, [0, 1], bank, [0])
    with pytest.raises(ValueError, match="kinds"):
        dev.copy_rows_async(slots, [0], {"gate_up": bank["gate_up"]}, [0])
    wrong = dict(bank, gate_up=bank["gate_up"].double())
    with pytest.raises(ValueError, match="gate_up"):
        dev.copy_rows_async(slots, [0], wrong, [0])
    assert dev.copy_rows_async(slots, [], bank, []).done()


def test_copies_are_paced_to_b_p() -> None:
    b_p = 200 * MB
    nbytes = 40 * MB  # 0.2 s at 200 MB/s
    bank = _big_bank(nbytes)
    dev = EmulatedDevice(b_p=b_p)
    slots = dev.alloc_slots(4, slot_layout(bank))
    started = time.perf_counter()
    handle = dev.copy_rows_async(slots, [0, 1, 2, 3], bank, [3, 2, 1, 0])
    assert not handle.done(), "a 0.2 s paced copy finished at once: it is not asynchronous"
    handle.wait()
    elapsed = time.perf_counter() - started
    expected = nbytes / b_p
    # Pacing is a lower bound (never faster than B_P); a busy machine may only make it slower, so the
    # upper bounds are loose: they catch a copy that never finishes, not a slow scheduler.
    assert 0.7 * expected <= elapsed <= 10 * expected, f"{nbytes} B at {b_p} B/s took {elapsed:.3f} s"
    assert 0.7 * expected <= handle.seconds <= 10 * expected
    assert torch.equal(slots["w"][0], bank["w"][3]) and torch.equal(slots["w"][3], bank["w"][0])
    stats = dev.stats()
    assert stats.bytes_copied == nbytes and 0.1 * b_p <= stats.copy_bytes_per_second <= 1.43 * b_p


def test_fast_links_are_reached() -> None:
    # the copy thread itself must sustain GB/s: a slow memcpy path would cap every b_p above it
    b_p = 1000 * MB
    bank = _big_bank(100 * MB)
    dev = EmulatedDevice(b_p=b_p)
    slots = dev.alloc_slots(4, slot_layout(bank))
    handle = dev.copy_rows_async(slots, [0, 1, 2, 3], bank, [0, 1, 2, 3])
    handle.wait()
    # a memcpy path slower than ~0.2 GB/s would take more than 0.5 s (loose: the machine may be busy)
    assert 0.7 * 0.1 <= handle.seconds <= 0.5, f"100 MB at 1 GB/s took {handle.seconds:.3f} s"
    assert torch.equal(slots["w"], bank["w"])


def test_queued_copies_share_the_link() -> None:
    b_p = 200 * MB
    bank = _big_bank(20 * MB, num_rows=2)
    dev = EmulatedDevice(b_p=b_p)
    slots = dev.alloc_slots(2, slot_layout(bank))
    started = time.perf_counter()
    first = dev.copy_rows_async(slots, [0], bank, [0])
    second = dev.copy_rows_async(slots, [1], bank, [1])
    second.wait()
    elapsed = time.perf_counter() - started
    assert first.done(), "copies finish in submission order"
    # 20 MB in all: two 10 MB copies back to back, not in parallel (that would take ~0.05 s)
    assert 0.7 * 0.1 <= elapsed <= 10 * 0.1, elapsed


def test_idle_link_does_not_bank_credit() -> None:
    b_p = 200 * MB
    bank = _big_bank(20 * MB, num_rows=2)
    dev = EmulatedDevice(b_p=b_p)
    slots = dev.alloc_slots(2, slot_layout(bank))
    dev.copy_rows_async(slots, [0], bank, [0]).wait()
    time.sleep(0.15)  # idle: must not let the next copy run faster than b_p
    handle = dev.copy_rows_async(slots, [1], bank, [1])
    handle.wait()
    assert handle.seconds >= 0.7 * 0.05, handle.seconds


def test_wait_timeout_then_completion() -> None:
    bank = _big_bank(10 * MB, num_rows=1)
    dev = EmulatedDevice(b_p=20 * MB)  # 0.5 s
    slots = dev.alloc_slots(1, slot_layout(bank))
    handle = dev.copy_rows_async(slots, [0], bank, [0])
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.01)
    handle.wait(timeout=10)
    assert handle.done() and torch.equal(slots["w"][0], bank["w"][0])


def test_move_slots_is_order_safe() -> None:
    bank = _bank()
    dev = EmulatedDevice(b_p=float("inf"))
    slots = dev.alloc_slots(5, slot_layout(bank))
    dev.copy_rows_async(slots, [0, 1, 2, 3, 4], bank, [0, 1, 2, 3, 4]).wait()
    # a swap and a chain that overwrites its own sources: both need all reads before writes
    dev.move_slots(slots, [(0, 1), (1, 0), (3, 2), (4, 3)])
    for kind, t in slots.items():
        for slot, row in {0: 1, 1: 0, 2: 3, 3: 4, 4: 4}.items():
            assert torch.equal(t[slot], bank[kind][row]), (kind, slot)
    with pytest.raises(ValueError, match="twice"):
        dev.move_slots(slots, [(0, 2), (1, 2)])


def test_resize_keeps_moved_rows_and_capacity_accounting() -> None:
    bank = _bank()
    layout = slot_layout(bank)
    per_slot = slot_nbytes(layout)
    dev = EmulatedDevice(b_p=float("inf"), capacity_bytes=20 * per_slot)
    slots = dev.alloc_slots(6, layout)
    dev.copy_rows_async(slots, list(range(6)), bank, [9, 8, 7, 6, 5, 4]).wait()
    bigger = dev.resize_slots(slots, 9, [(i, i) for i in range(6)])
    assert slots == {} and dev.info().free_bytes == 11 * per_slot
    assert all(t.shape[0] == 9 for t in bigger.values())
    smaller = dev.resize_slots(bigger, 2, [(5, 0), (1, 1)])  # compact the two survivors
    for kind, t in smaller.items():
        assert t.shape[0] == 2
        assert torch.equal(t[0], bank[kind][4]) and torch.equal(t[1], bank[kind][8])
    assert dev.info().free_bytes == 18 * per_slot
    with pytest.raises(ValueError, match="out of range"):
        dev.resize_slots(smaller, 1, [(0, 1)])


def test_resize_waits_for_queued_copies() -> None:
    bank = _big_bank(4 * MB, num_rows=2)
    dev = EmulatedDevice(b_p=40 * MB)  # 0.1 s of copying still queued when resize is called
    slots = dev.alloc_slots(2, slot_layout(bank))
    dev.copy_rows_async(slots, [0, 1], bank, [1, 0])
    new = dev.resize_slots(slots, 2, [(0, 1), (1, 0)])
    assert torch.equal(new["w"][1], bank["w"][1]) and torch.equal(new["w"][0], bank["w"][0])


def test_charge_compute_books_time_without_sleeping() -> None:
    dev = EmulatedDevice(b_dev=1e9)
    started = time.perf_counter()
    assert dev.charge_compute(500 * MB) == pytest.approx(0.5)
    assert dev.charge_compute(250 * MB) == pytest.approx(0.25)
    assert time.perf_counter() - started < 0.5, "charge_compute slept without sleep_compute (0.75 s charged)"
    stats = dev.stats()
    assert stats.num_compute_charges == 2 and stats.compute_bytes == 750 * MB
    assert stats.compute_seconds == pytest.approx(0.75)
    with pytest.raises(ValueError):
        dev.charge_compute(-1)


def test_sleep_compute_sleeps_the_charged_time() -> None:
    dev = EmulatedDevice(b_dev=1e9, sleep_compute=True)
    started = time.perf_counter()
    charged = dev.charge_compute(60 * MB)
    assert charged == pytest.approx(0.06)
    assert time.perf_counter() - started >= 0.055


def test_many_threads_copy_without_deadlock() -> None:
    bank = _bank(num_rows=64, seed=1)
    dev = EmulatedDevice(b_p=2e9, chunk_bytes=4096)
    slots = dev.alloc_slots(64, slot_layout(bank))
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for rep in range(25):
                mine = [w * 8 + i for i in range(8)]  # each thread owns 8 slots
                rows = [(r + rep) % 64 for r in mine]
                dev.copy_rows_async(slots, mine, bank, rows).wait(timeout=20)
                if rep % 5 == 0:
                    dev.charge_compute(1000)
                    dev.stats()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "copy threads deadlocked"
    assert not errors, errors
    dev.synchronize()
    for kind, t in slots.items():
        for slot in range(64):
            assert torch.equal(t[slot], bank[kind][(slot + 24) % 64]), (kind, slot)
    assert dev.stats().num_copies == 8 * 25


def test_close_stops_the_copy_thread_and_a_new_copy_restarts_it() -> None:
    bank = _bank()
    dev = EmulatedDevice(b_p=float("inf"))
    slots = dev.alloc_slots(2, slot_layout(bank))
    before = set(threading.enumerate())
    dev.copy_rows_async(slots, [0], bank, [1]).wait()
    mine = [t for t in set(threading.enumerate()) - before if t.name == "moed-emulated-copy"]
    assert len(mine) == 1 and mine[0].is_alive(), "one persistent copy thread per device"
    dev.copy_rows_async(slots, [1], bank, [0]).wait()
    assert mine[0].is_alive() and len([t for t in set(threading.enumerate()) - before if t.name == mine[0].name]) == 1
    dev.close()
    assert not mine[0].is_alive()
    dev.copy_rows_async(slots, [1], bank, [2]).wait(timeout=5)
    assert torch.equal(slots["gate_up"][1], bank["gate_up"][2])
    dev.close()


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="b_p"):
        EmulatedDevice(b_p=0)
    with pytest.raises(ValueError, match="b_dev"):
        EmulatedDevice(b_dev=-1)
    with pytest.raises(ValueError, match="capacity_bytes"):
        EmulatedDevice(capacity_bytes=-5)


def test_the_timing_model_is_a_roofline_and_bad_settings_are_refused() -> None:
    dev = EmulatedDevice(b_p=1e9, b_dev=1e9, flops_dev=1e12)
    assert dev.charge_compute(10**9) == pytest.approx(1.0)  # bytes dominate
    assert dev.charge_compute(10**6, flops=3e12) == pytest.approx(3.0)  # FLOPs dominate
    with pytest.raises(ValueError, match="flops"):
        dev.charge_compute(1, flops=-1.0)
    with pytest.raises(ValueError, match="flops_dev"):
        EmulatedDevice(flops_dev=0)
    with pytest.raises(ValueError, match="sleep_compute"):
        EmulatedDevice(timing_only=True)


def test_engine_config_refuses_other_prefill_buffer_counts() -> None:
    from moed.config import EngineConfig
    from moed.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prefill_buffers"):
        EngineConfig(prefill_buffers=3)
    assert EngineConfig(prefill_buffers=1).prefill_buffers == 1
