"""moed: a local daemon that runs Mixture-of-Experts models bigger than GPU memory."""

import os as _os

# torch and numba each bring an OpenMP runtime whose idle threads spin for a long while after
# every parallel region. With both active on a small machine they starve each other (measured:
# decode 16 -> 2 tok/s when device compute and torch ops alternate). A short spin keeps kernels
# as fast as before (docs/benchmarks.md) without the fight. Must be set before torch/numba load.
_os.environ.setdefault("GOMP_SPINCOUNT", "1000")

__version__ = "0.1.0"
