"""cuda_kernels without a GPU: the torch twins against a float64 oracle, the wrapper's checks, the kernel source."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from moed.devices import cuda_kernels as ck
from moed.kernels.int4_format import INT4_GROUP_SIZE, dequantize_int4, quantize_int4

from helpers import int4_oracle as oracle  # float64 oracles, never the code under test


def _int4_slots(num_slots: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    w = torch.randn(num_slots, k, n, generator=torch.Generator().manual_seed(seed))
    return (w, *quantize_int4(w))


def test_group_size_matches_the_bank_format() -> None:
    assert ck.INT4_GROUP_SIZE == INT4_GROUP_SIZE


def test_reference_matches_a_float64_oracle() -> None:
    # the twin (the CPU path, and the GPU tests' old yardstick) against float64 math on the exact weights
    w, q, scale, mn = _int4_slots(3, 64, 48)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=gen)
    slot_ids, offsets = [2, 0, 2], [0, 1, 1, 7]  # an expert with no tokens, a slot used twice
    y = ck.int4_grouped_matmul_reference(x, q, scale, mn, slot_ids, offsets)
    assert y.shape == (7, 48) and y.dtype == torch.float32
    ref = oracle.grouped_f64(x, oracle.dequant_f64(q, scale, mn), slot_ids, offsets)
    bound = oracle.fp32_bound(x, oracle.int4_magnitude(q, scale, mn), slot_ids, offsets)
    oracle.assert_within(y, ref, bound, "int4_grouped_matmul_reference")
    # the quantized product is close to the float one (the format is sane)
    assert (y[1:] - x[1:] @ w[2]).abs().max() < 0.1 * (x[1:] @ w[2]).abs().max()
    y1 = ck.int4_matmul_reference(x, q[1], scale[1], mn[1])
    oracle.assert_within(y1, oracle.grouped_f64(x, oracle.dequant_f64(q, scale, mn), [1], [0, 7]),
                         oracle.fp32_bound(x, oracle.int4_magnitude(q, scale, mn), [1], [0, 7]), "int4_matmul_reference")


def test_many_rows_gemm_form_matches_a_float64_oracle(monkeypatch) -> None:
    # prefill's form (dequantise the call's slots a chunk at a time, one GEMM per expert) runs on any device
    monkeypatch.setattr(ck, "DEQUANT_CHUNK_BYTES", 2 * 64 * 96 * 4)  # two slots per chunk: chunk edges are crossed
    _, q, scale, mn = _int4_slots(5, 64, 96, seed=4)
    counts = [40, 0, 70, 33, 1]
    slot_ids = [4, 1, 0, 4, 2]  # a slot used twice, an expert with no rows
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    x = torch.randn(offsets[-1], 64, generator=torch.Generator().manual_seed(5))
    y = ck.int4_grouped_gemm(x, q, scale, mn, slot_ids, offsets)
    ref = oracle.grouped_f64(x, oracle.dequant_f64(q, scale, mn), slot_ids, offsets)
    oracle.assert_within(y, ref, oracle.fp32_bound(x, oracle.int4_magnitude(q, scale, mn), slot_ids, offsets),
                         "int4_grouped_gemm")
    w = ck.dequantize_slots(q[[3, 1]], scale[[3, 1]], mn[[3, 1]])
    assert torch.equal(w[0], ck.dequantize_slot(q[3], scale[3], mn[3]))
    assert torch.equal(w[1], ck.dequantize_slot(q[1], scale[1], mn[1]))


def test_oracle_agrees_with_the_bank_dequantizer() -> None:
    # the oracle restates the format; the bank's own dequantizer must read the same weights
    _, q, scale, mn = _int4_slots(2, 96, 34, seed=4)
    exact = oracle.dequant_f64(q, scale, mn)
    diff = (dequantize_int4(q, scale, mn).double() - exact).abs()
    assert float((diff - 2 * oracle.U32 * oracle.int4_magnitude(q, scale, mn)).max()) <= 0.0


def test_reference_on_a_hand_computed_case_is_exact() -> None:
    # small dyadic numbers: the layout (nibble -> column, group -> rows, slot) decides every digit
    x, q, scale, mn, expected = oracle.hand_case()
    y = ck.int4_grouped_matmul_reference(x, q, scale, mn, oracle.HAND_SLOT_IDS, oracle.HAND_OFFSETS)
    assert torch.equal(y, expected), (y, expected)
    assert torch.equal(ck.int4_matmul_reference(x[2:], q[0], scale[0], mn[0]), expected[2:])


def test_grouped_matmul_dispatches_by_format_on_cpu() -> None:
    _, q, scale, mn = _int4_slots(2, 32, 16)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    slots = {"down.q": q, "down.scale": scale, "down.min": mn}
    oracle.assert_within(ck.grouped_matmul(x, slots, "down", [1], [0, 3]),
                         oracle.grouped_f64(x, oracle.dequant_f64(q, scale, mn), [1], [0, 3]),
                         oracle.fp32_bound(x, oracle.int4_magnitude(q, scale, mn), [1], [0, 3]), "int4 slots")
    w = torch.randn(2, 32, 16, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        wd = w.to(dtype)
        ids, offs = [1, 0], [0, 2, 3]
        y = ck.grouped_matmul(x, {"down": wd}, "down", ids, offs)
        w64 = wd.double()  # bf16 -> float64 is exact: the weights the slots really hold
        oracle.assert_within(y, oracle.grouped_f64(x, w64, ids, offs), oracle.fp32_bound(x, w64.abs(), ids, offs),
                             f"{dtype} slots")
    with pytest.raises(ValueError, match="no matrix"):
        ck.grouped_matmul(x, {"down": w}, "gate_up", [0], [0, 3])


def test_wrapper_checks_before_launch() -> None:
    _, q, scale, mn = _int4_slots(2, 64, 32)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="float32"):
        ck.int4_grouped_matmul(x.double(), q, scale, mn, [0], [0, 4])
    with pytest.raises(ValueError, match="columns"):
        ck.int4_grouped_matmul(torch.randn(4, 32), q, scale, mn, [0], [0, 4])
    with pytest.raises(ValueError, match="bfloat16"):
        ck.int4_grouped_matmul(x, q, scale.float(), mn, [0], [0, 4])
    with pytest.raises(ValueError, match="contiguous"):
        ck.int4_grouped_matmul(x.t().contiguous().t(), q, scale, mn, [0], [0, 4])
    with pytest.raises(ValueError, match="out of range"):
        ck.int4_grouped_matmul(x, q, scale, mn, [2], [0, 4])
    with pytest.raises(ValueError, match="rise from 0"):
        ck.int4_grouped_matmul(x, q, scale, mn, [0, 1], [0, 3, 2])
    with pytest.raises(ValueError, match="len"):
        ck.int4_grouped_matmul(x, q, scale, mn, [0, 1], [0, 4])
    with pytest.raises(ValueError, match="multiple"):
        ck.int4_grouped_matmul(torch.randn(4, 48), torch.zeros(1, 48, 16, dtype=torch.uint8),
                               torch.zeros(1, 1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, 32, dtype=torch.bfloat16),
                               [0], [0, 4])
    with pytest.raises(ValueError, match="CUDA"):  # valid arguments, but CPU tensors: points at the twin
        ck.int4_grouped_matmul(x, q, scale, mn, [0], [0, 4])


def test_kernel_source_is_found_and_missing_source_is_explained(tmp_path) -> None:
    path = ck.kernel_source_path()
    assert path.name == ck.KERNEL_FILE and ck.KERNEL_NAME in path.read_text()
    with pytest.raises(FileNotFoundError, match="native/"):
        ck.kernel_source_path(tmp_path)


def test_kernel_constants_match_the_wrapper() -> None:
    src = ck.kernel_source_path().read_text()
    assert f"#define BLOCK {ck._BLOCK}" in src and f"#define GROUP {ck.INT4_GROUP_SIZE}" in src


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile-check the kernel")
def test_kernel_source_compiles(tmp_path) -> None:
    result = subprocess.run(
        ["nvcc", "--ptx", "-arch=compute_80", "-o", str(tmp_path / "k.ptx"), str(ck.kernel_source_path())],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert ck.KERNEL_NAME in (tmp_path / "k.ptx").read_text()


def test_importing_devices_does_not_import_cupy() -> None:
    code = "import sys, moed.devices, moed.devices.cuda_kernels; sys.exit('cupy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
