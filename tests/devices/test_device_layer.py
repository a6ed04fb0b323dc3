"""The device layer as a whole: it imports nothing else from moed, the cpu device, select_device, the Protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from moed.devices import CpuDevice, Device, EmulatedDevice, select_device, slot_layout

DEVICES = Path(__file__).resolve().parents[2] / "daemon" / "devices"


def test_devices_import_nothing_else_from_moed() -> None:
    files = sorted(DEVICES.glob("*.py"))
    assert files, f"no sources under {DEVICES}"
    problems = []
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 1:
                    problems.append(f"{file.name}: relative import reaching above devices/")
                names = [node.module or ""] if node.level == 0 else []
            else:
                continue
            for name in names:
                if name == "moed" or (name.startswith("moed.") and not name.startswith("moed.devices")):
                    problems.append(f"{file.name} imports {name}")
    assert not problems, problems


def test_devices_follow_the_protocol() -> None:
    assert isinstance(CpuDevice(), Device) and isinstance(EmulatedDevice(), Device)


def test_cpu_device_has_no_slots() -> None:
    dev = CpuDevice()
    bank = {"gate_up": torch.randn(4, 8, 6), "down": torch.randn(4, 3, 8)}
    layout = slot_layout(bank)
    slots = dev.alloc_slots(0, layout)
    assert {k: tuple(t.shape) for k, t in slots.items()} == {"gate_up": (0, 8, 6), "down": (0, 3, 8)}
    with pytest.raises(ValueError, match="no slot memory"):
        dev.alloc_slots(2, layout)
    assert dev.copy_rows_async(slots, [], bank, []).done()
    with pytest.raises(ValueError, match="out of range"):
        dev.copy_rows_async(slots, [0], bank, [1])
    assert dev.resize_slots(slots, 0, []) is slots
    with pytest.raises(ValueError, match="no slot memory"):
        dev.resize_slots(slots, 3, [])
    assert dev.charge_compute(10**9) == 0.0 and dev.stats().bytes_copied == 0
    info = dev.info()
    assert info.kind == "cpu" and info.total_bytes == 0


def test_select_device_by_name() -> None:
    assert select_device("cpu").kind == "cpu"
    dev = select_device("emulated", b_p=1e9, b_dev=2e9, capacity_bytes=1000)
    assert isinstance(dev, EmulatedDevice) and (dev.b_p, dev.b_dev, dev.capacity_bytes) == (1e9, 2e9, 1000)
    # one option set serves every name: options of the other devices are ignored
    assert select_device("cpu", b_p=1e9, b_dev=2e9).kind == "cpu"
    assert select_device(" Emulated ").kind == "emulated"
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        select_device("gpu")
    with pytest.raises(ValueError, match=r"no device takes option\(s\) \['bp'\]"):
        select_device("emulated", bp=1e9)


def test_auto_falls_back_to_cpu_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto picks it (tested in test_cuda_device.py)")
    assert select_device().kind == "cpu" and select_device(None).kind == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        select_device("cuda")
