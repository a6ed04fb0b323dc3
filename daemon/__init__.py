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

# oneDNN (torch's bf16 GEMMs on CPUs that run them natively) caches a compiled primitive per GEMM shape,
# in two LRU caches of 1024 entries each: its own and torch's ideep layer above it. Prefill multiplies
# each expert's tokens (a different count per expert and step: hundreds of shapes) and every entry
# holds ~0.25-0.3 MB, so the caches grew to ~0.5 GiB of the peak. 128 entries each: a 4-layer
# Qwen3-30B-A3B-shaped Q4_K_M model, 8k prompt, peak RSS 3.06 -> 2.73 GiB, TTFT 25.9 -> 27.0 s
# (docs/benchmarks.md "Long prompts"). Read at the first GEMM; set either variable to override.
_os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
_os.environ.setdefault("LRU_CACHE_CAPACITY", "128")

__version__ = "0.1.0"
