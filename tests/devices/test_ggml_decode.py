"""native/ggml_decode.h (the per-weight decoders of the GPU kernels in native/ggml_rows.cu), built here with
gcc: every weight of random rows of every kept type is the torch decoders' value, bit for bit; the CUDA
source compiles with nvcc where the toolkit is present (issue #31 item 3)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from moed.devices import cuda_kernels as ck
from moed.experts.kernel_bench import random_rows
from moed.kernels import gguf_quants as q
from moed.kernels.ggml_rows_format import ROW_TYPES, row_bytes

SHIM = r"""
#include "ggml_decode.h"
void decode_rows(int type, const unsigned char* rows, int n, int row_bytes, int k, float* out) {
    for (int r = 0; r < n; ++r)
        for (int i = 0; i < k; ++i) out[(long)r * k + i] = moed_ggml_weight(type, rows + (long)r * row_bytes, i);
}
"""


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the decoders' header")
    folder = tmp_path_factory.mktemp("ggml_decode")
    (folder / "shim.c").write_text(SHIM)
    lib = folder / "shim.so"
    # -ffp-contract=off: the reference's products and sums round one at a time (no fused multiply-add)
    cmd = ["gcc", "-O2", "-std=c11", "-Wall", "-Werror", "-ffp-contract=off", "-shared", "-fPIC",
           f"-I{ck.native_source_dir()}", "-o", str(lib), str(folder / "shim.c")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    dll = ctypes.CDLL(str(lib))
    dll.decode_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]

    def decode(raw: torch.Tensor, ggml_type: int, k: int) -> torch.Tensor:
        out = torch.empty(raw.shape[0], k, dtype=torch.float32)
        dll.decode_rows(ggml_type, raw.data_ptr(), raw.shape[0], raw.shape[1], k, out.data_ptr())
        return out

    return decode


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN where the reference has none (or the reverse)"
    same = got.view(torch.int32) == want.view(torch.int32)
    bad = (~same & ~nan).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} weights differ, first at {bad[0].tolist()}: " \
                             f"{float(got[tuple(bad[0])])} vs {float(want[tuple(bad[0])])}"


@pytest.mark.parametrize("ggml_type", ROW_TYPES, ids=q.type_name)
def test_every_weight_is_the_torch_decoders(decoder, ggml_type):
    weights = q.block_size(ggml_type)[0]
    k = 3 * max(weights, 64)  # several blocks a row
    gen = torch.Generator().manual_seed(ggml_type)
    valid = random_rows(q.type_name(ggml_type), (5,), k, gen)  # moderate scales, as files have
    wild = torch.randint(0, 256, (7, row_bytes(ggml_type, k)), dtype=torch.uint8, generator=gen)  # any byte anywhere
    for name, raw in (("valid rows", valid), ("random bytes", wild)):
        want = q.dequantize(raw.reshape(-1), ggml_type, (raw.shape[0], k))
        assert_same_bits(decoder(raw, ggml_type, k), want, f"{q.type_name(ggml_type)} {name}")


def test_every_kept_type_has_a_kernel():
    src = (ck.native_source_dir() / ck.GGML_KERNEL_FILE).read_text()
    assert set(ck.GGML_KERNEL_TYPES) == set(ROW_TYPES)
    assert {int(t) for t in re.findall(r"^MOED_GGML_KERNEL\((\d+)\)", src, flags=re.M)} == set(ROW_TYPES)
    assert f"#define WARPS {ck.GGML_WARPS}" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile-check the kernels")
def test_the_cuda_source_compiles(tmp_path):
    ptx = tmp_path / "ggml_rows.ptx"
    result = subprocess.run(["nvcc", "--ptx", "-arch=compute_80", f"-I{ck.native_source_dir()}", "-o", str(ptx),
                             str(ck.native_source_dir() / ck.GGML_KERNEL_FILE)], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr
    entries = set(re.findall(r"\.entry (ggml_rows_matmul_\d+)", ptx.read_text()))
    assert entries == {ck.ggml_kernel_name(t) for t in ROW_TYPES}


def test_random_rows_of_every_type_are_finite(decoder):
    """The test data above is meaningful: valid rows decode to finite, mostly nonzero weights."""
    for ggml_type in ROW_TYPES:
        raw = random_rows(q.type_name(ggml_type), (2,), 256, torch.Generator().manual_seed(1))
        w = decoder(raw, ggml_type, 256)
        assert bool(torch.isfinite(w).all()) and float((w != 0).float().mean()) > 0.5, q.type_name(ggml_type)
        assert not np.isnan(float(w.abs().sum()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ggml_type", ROW_TYPES, ids=q.type_name)
def test_the_cuda_kernel_is_x_times_the_decoded_rows(ggml_type):
    """Every type's kernel on a GPU against float64 products of the torch-decoded rows: slots in any order,
    an expert without rows, one with more rows than a tile, a factor per slot, rows not a multiple of the
    CUDA block's."""
    k, rows, num_slots = 2 * max(q.block_size(ggml_type)[0], 128), 37, 5
    width = rows * row_bytes(ggml_type, k) + 40  # slots wider than this matrix, as a ggml bank's are
    gen = torch.Generator().manual_seed(ggml_type)
    store = torch.zeros(num_slots, width, dtype=torch.uint8)
    for s in range(num_slots):
        store[s, :width - 40] = random_rows(q.type_name(ggml_type), (rows,), k, gen).reshape(-1)
    slot_ids, counts = [3, 0, 4, 1], [2, 0, 11, 1]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    x = torch.randn(offsets[-1], k, generator=gen)
    factor = torch.rand(num_slots, generator=gen) + 0.5
    dev = torch.device("cuda")
    for f in (None, factor):
        got = ck.ggml_rows_grouped_matmul(x.to(dev), store.to(dev), ggml_type, rows, row_bytes(ggml_type, k),
                                          slot_ids, offsets, None if f is None else f.to(dev)).cpu()
        for e, s in enumerate(slot_ids):
            a, b = offsets[e], offsets[e + 1]
            w = q.dequantize(store[s, :width - 40].contiguous(), ggml_type, (rows, k)).double()
            want = x[a:b].double() @ w.T * (1.0 if f is None else float(f[s]))
            if b > a:
                assert torch.allclose(got[a:b].double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), (e, f)
