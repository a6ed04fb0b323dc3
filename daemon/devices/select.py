"""Pick the device by name: "auto" (CUDA when it works, else cpu), "cuda", "emulated" or "cpu"."""

from __future__ import annotations

import inspect
from typing import Any

from .cpu import CpuDevice
from .cuda import CudaDevice
from .device import Device
from .emulated import EmulatedDevice
from .pinning import can_pin

DEVICE_NAMES = ("auto", "cuda", "emulated", "cpu")
_CLASSES: dict[str, type] = {"cuda": CudaDevice, "emulated": EmulatedDevice, "cpu": CpuDevice}


def _params(name: str) -> set[str]:
    return set(inspect.signature(_CLASSES[name]).parameters)


def _make(name: str, opts: dict[str, Any]) -> Device:
    """Build device ``name``; options that only another device takes are dropped (callers pass one set for all)."""
    known = set().union(*(_params(n) for n in _CLASSES))
    unknown = sorted(set(opts) - known)
    if unknown:
        takes = "; ".join(f"{n}: {', '.join(sorted(_params(n))) or 'none'}" for n in _CLASSES)
        raise ValueError(f"no device takes option(s) {unknown} (options by device: {takes})")
    mine = _params(name)
    return _CLASSES[name](**{k: v for k, v in opts.items() if k in mine})


def cpu_only(name: str | None = "auto") -> bool:
    """Whether device ``name`` runs everything on the CPU: "cpu", or "auto" on a machine where torch
    sees no CUDA GPU (a load then picks the CPU's expert bank: ``model_loader.load_model(cpu_only=)``)."""
    name = "auto" if name is None else str(name).strip().lower()
    return name == "cpu" or (name == "auto" and not CudaDevice.available())


def select_device(name: str | None = "auto", **opts: Any) -> Device:
    """The device called ``name`` (None means "auto"), built with the ``opts`` it takes.

    Options of the other devices are ignored (``select_device(cfg.device, b_p=..., b_dev=...)``
    works for every name); an option no device takes is an error.

    "auto" is CUDA when torch sees a GPU and host memory can be registered for DMA, else the
    CPU-only backend ("emulated" is never chosen automatically: it is for tests and benchmarks).
    """
    name = "auto" if name is None else str(name).strip().lower()
    if name not in DEVICE_NAMES:
        raise ValueError(f"unknown device {name!r}: choose one of {', '.join(DEVICE_NAMES)}")
    if name == "auto":
        name = "cuda" if CudaDevice.available() and can_pin() else "cpu"
    elif name == "cuda" and not CudaDevice.available():
        raise RuntimeError(
            "device 'cuda' was asked for but torch sees no CUDA GPU (torch.cuda.is_available() is False): "
            "check the NVIDIA driver and that torch is a CUDA build, or use device 'auto' or 'cpu'"
        )
    return _make(name, opts)
