"""Run a block without the native CPU kernels: the numba ones (float32 activations) take over.

The format tests check that weights load exactly; the native kernels for q8 / int4 / mxfp4 banks
quantise activations to int8 (as llama.cpp does), which is tested on its own against torch twins
(tests/kernels/test_native_cpu.py) and at model level within its own tolerance.
"""

from __future__ import annotations

import contextlib

import moed.kernels.native_cpu as native_cpu


@contextlib.contextmanager
def without_native_kernels():
    saved = native_cpu._native, native_cpu._loaded
    native_cpu._native, native_cpu._loaded = None, True
    try:
        yield
    finally:
        native_cpu._native, native_cpu._loaded = saved
