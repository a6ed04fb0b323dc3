"""CudaDevice and the CUDA kernels on a real GPU: int4 kernel vs its torch twin, pinned copies, a decode step."""

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
from moed.experts.expert_ffn import apply_activation, run_expert_reference  # noqa: E402
from moed.kernels.int4_format import quantize_int4  # noqa: E402


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (y.float().cpu() - ref.float().cpu()).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    assert err <= rel * scale, f"max error {err:.3g} vs {rel} x max|ref| {scale:.3g}"


def _int4(num_slots: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    w = torch.randn(num_slots, k, n, generator=torch.Generator().manual_seed(seed))
    return tuple(t.cuda() for t in quantize_int4(w))


@pytest.mark.parametrize("k,n", [(32, 2), (64, 64), (128, 96), (512, 1024), (2048, 768)])
@pytest.mark.parametrize("counts", [[1], [1, 1, 1], [0, 3, 9], [17, 1, 8, 0]])
def test_int4_kernel_matches_reference(k: int, n: int, counts: list[int]) -> None:
    q, scale, mn = _int4(4, k, n, seed=k + n)
    x = torch.randn(sum(counts), k, device="cuda")
    slot_ids = [(3 * e + 1) % 4 for e in range(len(counts))]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    y = ck.int4_grouped_matmul(x, q, scale, mn, slot_ids, offsets)
    ref = ck.int4_grouped_matmul_reference(x.cpu(), q.cpu(), scale.cpu(), mn.cpu(), slot_ids, offsets)
    assert y.shape == (sum(counts), n) and y.dtype == torch.float32 and y.is_cuda
    _close(y, ref, 1e-4)
    # device-side indices (no host round trip) give the same result
    ids_t = torch.tensor(slot_ids, dtype=torch.int32, device="cuda")
    offs_t = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    torch.testing.assert_close(ck.int4_grouped_matmul(x, q, scale, mn, ids_t, offs_t), y)


def test_int4_kernel_on_a_side_stream_and_single_matrix() -> None:
    q, scale, mn = _int4(2, 256, 512, seed=3)
    x = torch.randn(5, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = ck.int4_matmul(x, q[1], scale[1], mn[1])
    torch.cuda.current_stream().wait_stream(side)
    _close(y, ck.int4_matmul_reference(x.cpu(), q[1].cpu(), scale[1].cpu(), mn[1].cpu()), 1e-4)
    assert ck.int4_grouped_matmul(x[:0], q, scale, mn, [], [0]).shape == (0, 512)


def test_grouped_matmul_fp32_bf16_on_cuda() -> None:
    w = torch.randn(3, 64, 40)
    x = torch.randn(6, 64)
    for dtype in (torch.float32, torch.bfloat16):
        y = ck.grouped_matmul(x.cuda(), {"down": w.to(dtype).cuda()}, "down", [2, 0], [0, 4, 6])
        ref = ck.grouped_matmul(x, {"down": w.to(dtype)}, "down", [2, 0], [0, 4, 6])
        _close(y, ref, 1e-5)


def _bank_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, scale, mn = quantize_int4(torch.randn(12, 64, 48, generator=gen))
    return {"w.q": q, "w.scale": scale, "w.min": mn, "bias": torch.randn(12, 48, generator=gen)}


def test_pinned_copy_rows_land_in_slots() -> None:
    bank = _bank_tensors()
    report = pin_host_tensors(list(bank.values()))
    try:
        assert report.method == "cudaHostRegister" and report.pinned_bytes > 0, report
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


def test_decode_step_on_cuda_matches_cpu_reference() -> None:
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
        ref = torch.cat([run_expert_reference(bank, 4, x[:2]), run_expert_reference(bank, 1, x[2:])])
        _close(y, ref, 1e-3)
    finally:
        unpin(report)


def test_select_device_and_info_on_cuda() -> None:
    assert can_pin()
    dev = select_device("auto")
    assert isinstance(dev, CudaDevice) and select_device("cuda", b_p=1.0).kind == "cuda"
    info = dev.info()
    assert info.kind == "cuda" and info.total_bytes >= info.free_bytes > 0 and info.name
    with pytest.raises(ValueError, match="out of range"):
        CudaDevice(index=torch.cuda.device_count())
