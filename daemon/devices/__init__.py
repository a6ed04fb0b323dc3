"""Devices behind one interface: where cached experts live (cuda / emulated / cpu), host pinning, CUDA kernels.

Imports nothing else from ``moed``. ``cuda_kernels`` (cupy) is not imported here: it loads lazily.
"""

from .cpu import CpuDevice
from .cuda import CudaCopy, CudaDevice
from .device import (
    CopyHandle,
    Device,
    DeviceInfo,
    DeviceMemoryError,
    DeviceStats,
    SlotLayout,
    SlotStore,
    slot_layout,
    slot_nbytes,
)
from .emulated import EmulatedCopy, EmulatedDevice
from .pinning import PinReport, can_pin, memlock_limit_bytes, pin_host_tensors, unpin
from .select import DEVICE_NAMES, select_device

__all__ = [
    "DEVICE_NAMES",
    "CopyHandle",
    "CpuDevice",
    "CudaCopy",
    "CudaDevice",
    "Device",
    "DeviceInfo",
    "DeviceMemoryError",
    "DeviceStats",
    "EmulatedCopy",
    "EmulatedDevice",
    "PinReport",
    "SlotLayout",
    "SlotStore",
    "can_pin",
    "memlock_limit_bytes",
    "pin_host_tensors",
    "select_device",
    "slot_layout",
    "slot_nbytes",
    "unpin",
]
