"""Shared fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from moed.kernels.native_cpu import native


@pytest.fixture(params=("scalar", "avx2", "avx512", "avx512vnni"))
def isa(request):
    """Each ISA of the native kernels this CPU has, set for the test and restored after it."""
    lib = native()
    if lib is None:
        pytest.skip("native CPU kernels not built")
    if request.param not in lib.available_isas():
        pytest.skip(f"this CPU has no {request.param}")
    previous = lib.set_isa(request.param)
    yield request.param
    lib.set_isa(previous)
