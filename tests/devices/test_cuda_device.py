"""CudaDevice and the CUDA kernels on a real GPU, against float64 oracles: int4 kernel, dense slots, pinned copies, a decode step."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from moed.cache.bank_builder import build_expert_bank  # noqa: E402
from moed.cache.host_bank import ExpertActivation  # noqa: E402
from moed.devices import CudaDevice, can_pin, pin_host_tensors, select_device, slot_layout, unpin  # noqa: E402
from moed.devices import cuda_kernels as ck  # noqa: E402
from moed.experts.expert_ffn import apply_activation  # noqa: E402
from moed.kernels.int4_format import quantize_int4  # noqa: E402

from helpers import int4_oracle as oracle  # noqa: E402  (float64 oracles, never the code under test)
from helpers.pin_check import assert_regions_pinned, region_bytes_in  # noqa: E402


def _int4(num_slots: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    w = torch.randn(num_slots, k, n, generator=torch.Generator().manual_seed(seed))
    return tuple(t.cuda() for t in quantize_int4(w))


def _check_int4(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor,
                slot_ids: list[int], offsets: list[int], what: str) -> None:
    """``y`` against float64 math on the exact int4 weights, within the float32 accumulation bound."""
    q, scale, mn = q.cpu(), scale.cpu(), mn.cpu()
    if q.dim() == 2:
        q, scale, mn = q[None], scale[None], mn[None]
    ref = oracle.grouped_f64(x, oracle.dequant_f64(q, scale, mn), slot_ids, offsets)
    oracle.assert_within(y, ref, oracle.fp32_bound(x, oracle.int4_magnitude(q, scale, mn), slot_ids, offsets), what)


def test_int4_kernel_on_a_hand_computed_case_is_exact() -> None:
    x, q, scale, mn, expected = (t.cuda() for t in oracle.hand_case())
    y = ck.int4_grouped_matmul(x, q, scale, mn, oracle.HAND_SLOT_IDS, oracle.HAND_OFFSETS)
    assert y.is_cuda and torch.equal(y.cpu(), expected.cpu()), (y, expected)


@pytest.mark.parametrize("k,n", [(32, 2), (64, 64), (128, 96), (512, 1024), (2048, 768)])
@pytest.mark.parametrize("counts", [[1], [1, 1, 1], [0, 3, 9], [17, 1, 8, 0]])
def test_int4_kernel_matches_a_float64_oracle(k: int, n: int, counts: list[int]) -> None:
    q, scale, mn = _int4(4, k, n, seed=k + n)
    x = torch.randn(sum(counts), k, device="cuda")
    slot_ids = [(3 * e + 1) % 4 for e in range(len(counts))]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    y = ck.int4_grouped_matmul(x, q, scale, mn, slot_ids, offsets)
    assert y.shape == (sum(counts), n) and y.dtype == torch.float32 and y.is_cuda
    _check_int4(y, x, q, scale, mn, slot_ids, offsets, f"K={k} N={n} counts={counts}")
    # device-side indices (no host round trip): the same kernel on the same data, bit for bit
    ids_t = torch.tensor(slot_ids, dtype=torch.int32, device="cuda")
    offs_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    assert torch.equal(ck.int4_grouped_matmul(x, q, scale, mn, ids_t, offs_t), y)


@pytest.mark.parametrize("counts", [[40, 0, 100, 33], [64] * 12])
def test_int4_many_rows_take_the_gemm_form_and_match_a_float64_oracle(counts: list[int]) -> None:
    q, scale, mn = _int4(4, 2048, 768, seed=9)
    slot_ids = [(5 * e + 2) % 4 for e in range(len(counts))]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    assert offsets[-1] >= ck.GEMM_MIN_ROWS_PER_EXPERT * len(counts)  # the prefill form is taken
    x = torch.randn(offsets[-1], 2048, device="cuda")
    y = ck.int4_grouped_matmul(x, q, scale, mn, slot_ids, offsets)
    _check_int4(y, x, q, scale, mn, slot_ids, offsets, f"GEMM form, counts={counts}")
    # the kernel (device-side indices always take it) computes the same function
    ids_t = torch.tensor(slot_ids, dtype=torch.int32, device="cuda")
    offs_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    _check_int4(ck.int4_grouped_matmul(x, q, scale, mn, ids_t, offs_t), x, q, scale, mn, slot_ids, offsets,
                f"kernel, counts={counts}")


def test_int4_kernel_runs_on_the_current_stream() -> None:
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        pytest.skip("this torch has no torch.cuda._sleep to hold a stream back")
    q, scale, mn = _int4(2, 256, 512, seed=3)
    x = torch.randn(5, 256, device="cuda")
    buf = torch.zeros_like(x)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        sleep(200_000_000)  # ~0.1 s of GPU time on `side` before buf gets its values
        buf.copy_(x)
        y = ck.int4_matmul(buf, q[1], scale[1], mn[1])  # on any other stream it would read the zeros
    torch.cuda.current_stream().wait_stream(side)
    _check_int4(y, x, q[1], scale[1], mn[1], [0], [0, 5], "single matrix on a side stream")
    assert ck.int4_grouped_matmul(x[:0], q, scale, mn, [], [0]).shape == (0, 512)


def test_grouped_matmul_fp32_bf16_on_cuda() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(3, 64, 40, generator=gen)
    x = torch.randn(6, 64, generator=gen)
    ids, offs = [2, 0], [0, 4, 6]
    for dtype in (torch.float32, torch.bfloat16):
        y = ck.grouped_matmul(x.cuda(), {"down": w.to(dtype).cuda()}, "down", ids, offs)
        assert y.is_cuda and y.dtype == torch.float32
        w64 = w.to(dtype).double()  # exact: the weights the slots hold
        oracle.assert_within(y, oracle.grouped_f64(x, w64, ids, offs), oracle.fp32_bound(x, w64.abs(), ids, offs),
                             f"{dtype} slots on CUDA")


def _bank_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, scale, mn = quantize_int4(torch.randn(12, 64, 48, generator=gen))
    return {"w.q": q, "w.scale": scale, "w.min": mn, "bias": torch.randn(12, 48, generator=gen)}


def test_pinned_copy_rows_land_in_slots() -> None:
    bank = _bank_tensors()
    report = pin_host_tensors(list(bank.values()))
    try:
        assert report.method == "cudaHostRegister" and report.pinned_bytes > 0, report
        assert_regions_pinned(report)  # what the report calls pinned, the driver does too
        for kind, t in bank.items():
            if region_bytes_in(t, report.regions) == t.numel() * t.element_size():
                assert t.is_pinned(), kind
        dev = CudaDevice()
        slots = dev.alloc_slots(5, slot_layout(bank))
        assert all(t.is_cuda for t in slots.values())
        dst, src = [4, 0, 1, 2], [7, 3, 10, 11]
        handle = dev.copy_rows_async(slots, dst, bank, src)
        handle.wait_stream()
        handle.wait()
        assert handle.done() and handle.seconds > 0
        for kind, t in slots.items():
            for d, s in zip(dst, src):
                assert torch.equal(t[d].cpu(), bank[kind][s]), (kind, d, s)
        assert dev.stats().bytes_copied == handle.nbytes == sum(bank[k][0].numel() * bank[k].element_size() for k in bank) * 4
        # pageable sources copy correctly too (just not asynchronously)
        pageable = {k: v.clone() for k, v in bank.items()}
        dev.copy_rows_async(slots, [3], pageable, [5]).wait()
        assert all(torch.equal(slots[k][3].cpu(), bank[k][5]) for k in bank)
        dev.move_slots(slots, [(4, 3), (3, 4)])
        assert all(torch.equal(slots[k][3].cpu(), bank[k][7]) and torch.equal(slots[k][4].cpu(), bank[k][5]) for k in bank)
        smaller = dev.resize_slots(slots, 2, [(4, 0), (0, 1)])
        assert all(torch.equal(smaller[k][0].cpu(), bank[k][5]) and torch.equal(smaller[k][1].cpu(), bank[k][3]) for k in bank)
        dev.synchronize()
    finally:
        unpin(report)


def test_decode_step_on_cuda_matches_a_float64_oracle() -> None:
    d, inter, num = 64, 96, 6
    gen = torch.Generator().manual_seed(5)
    bank = build_expert_bank(torch.randn(num, d, 2 * inter, generator=gen) * 0.2,
                             torch.randn(num, inter, d, generator=gen) * 0.2,
                             num_moe_layers=2, num_experts=3, dtype="int4", activation=ExpertActivation("silu"))
    report = pin_host_tensors(list(bank.tensors.values()))
    try:
        dev = CudaDevice()
        slots = dev.alloc_slots(4, slot_layout(bank.tensors))
        experts, slot_of = [4, 1], [2, 0]
        dev.copy_rows_async(slots, slot_of, bank.tensors, experts).wait_stream()
        x = torch.randn(5, d, generator=gen)
        offsets = [0, 2, 5]  # tokens 0-1 -> expert 4, tokens 2-4 -> expert 1
        h = ck.grouped_matmul(x.cuda(), slots, "gate_up", slot_of, offsets)  # [T, 2I]
        y = ck.grouped_matmul(apply_activation(h, bank.activation).contiguous(), slots, "down", slot_of, offsets)
        assert y.shape == (5, d) and y.is_cuda
        h, y = h.cpu(), y.cpu()  # waits for the copies and kernels before the bank is unpinned
    finally:
        unpin(report)
    # the oracle reads the bank rows of the experts (not the slots) and does everything in float64
    t = bank.tensors
    gu64, gu_a = (f(t["gate_up.q"], t["gate_up.scale"], t["gate_up.min"]) for f in (oracle.dequant_f64, oracle.int4_magnitude))
    dn64, dn_a = (f(t["down.q"], t["down.scale"], t["down.min"]) for f in (oracle.dequant_f64, oracle.int4_magnitude))
    h64 = oracle.grouped_f64(x, gu64, experts, offsets)
    eh = oracle.fp32_bound(x, gu_a, experts, offsets)
    oracle.assert_within(h, h64, eh, "gate_up")
    g, u, eg, eu = h64[:, :inter], h64[:, inter:], eh[:, :inter], eh[:, inter:]
    silu = g / (1.0 + torch.exp(-g))
    a64 = silu * u
    # propagate: |silu'| <= 1.1, and the float32 silu and product add a few roundings of |a|
    sa, ua = silu.abs() + 1.1 * eg, u.abs() + eu
    ea = 1.1 * eg * ua + sa * eu + 8 * oracle.U32 * sa * ua
    y64 = oracle.grouped_f64(a64, dn64, experts, offsets)
    ey = oracle.fp32_bound(a64.abs() + ea, dn_a, experts, offsets) + oracle.grouped_f64(ea, dn_a, experts, offsets)
    oracle.assert_within(y, y64, 2 * ey, "decode step")


def test_select_device_and_info_on_cuda() -> None:
    assert can_pin()
    dev = select_device("auto")
    assert isinstance(dev, CudaDevice) and select_device("cuda", b_p=1.0).kind == "cuda"
    info = dev.info()
    assert info.kind == "cuda" and info.total_bytes >= info.free_bytes > 0 and info.name
    with pytest.raises(ValueError, match="out of range"):
        CudaDevice(index=torch.cuda.device_count())
