"""moed: a local daemon that runs Mixture-of-Experts models bigger than GPU memory."""

import os as _os

# torch and numba each bring an OpenMP runtime whose idle threads spin for a long while after
# every parallel region. With both active on a small machine they starve each other (measured:
# decode 16 -> 2 tok/s when device compute and torch ops alternate). A short spin keeps kernels
# as fast as before (docs/benchmarks.md) without the fight. Must be set before torch/numba load.
_os.environ.setdefault("GOMP_SPINCOUNT", "1000")

# Transparent huge pages for torch's large host allocations (the expert bank, dense weights, KV):
# torch then aligns every allocation of 2 MiB or more to 2 MiB and madvises it. Decode streams all
# of these once per token; with 4 KiB pages a fragmented heap measured 37 instead of 50 GB/s for
# the same bf16 GEMV, and the whole decode step ~5% faster (docs/benchmarks.md). torch reads the
# variable once, at its first allocation, so it is set before torch loads; `=0` turns it off.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
