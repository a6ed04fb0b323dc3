"""Prefill's per-expert GEMMs come in hundreds of shapes (each expert gets its own token count); the
GEMM library's per-shape caches must not keep memory for all of them (moed/__init__.py caps both)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moed.kernels.prefill_gemm import _cpu_runs_natively

PROBE = r"""
import ctypes, sys
import moed  # what every moed process imports first
import torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
def held():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd
torch.set_num_threads(1)
w = torch.randn(2048, 768).to(torch.bfloat16)  # one expert's down projection at Qwen3-30B-A3B's widths
x = torch.randn(400, 2048).to(torch.bfloat16)
torch.matmul(x[:1], w)
before = held()
for m in range(2, 400):  # 398 token counts: 398 GEMM shapes
    torch.matmul(x[:m], w)
print((held() - before) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
@pytest.mark.skipif(not _cpu_runs_natively(__import__("torch").bfloat16),
                    reason="this CPU's bf16 GEMM is not oneDNN's: no shape caches to bound")
def test_many_gemm_shapes_keep_little_memory():
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env)
    grown_mib = float(out.stdout.strip().splitlines()[-1])
    # uncapped (1024 entries in each cache) this held ~280 MiB after 398 shapes; capped at 128 ~90
    assert grown_mib < 150, f"398 GEMM shapes left {grown_mib:.0f} MiB allocated"
