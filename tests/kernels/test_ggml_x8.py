"""Rows interleaved in eights (native/cpu/ggml_x8.h, kernels/ggml_x8_format.py, experts/cpu_layout.py): the
native packing against its torch twin, the x8 kernels against gguf-decoded rows, a ggml bank laid out for
the CPU against the same bank as stored, and the device path's refusal (issue #31)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import random_blocks
from moed.cache.host_bank import GGML_BANK, ExpertActivation, ExpertBank
from moed.config import EngineConfig
from moed.experts import cpu_layout
from moed.experts.cpu_layout import interleave_for_cpu
from moed.experts.executor_factory import build_executor
from moed.experts.expert_ffn import ggml_expert_gemm
from moed.experts.ggml_slots import slot_layout
from moed.experts.routed_ffn import run_routed
from moed.kernels import ggml_x8_format as x8
from moed.kernels.ggml_rows_format import act_span, dequantize_rows, row_bytes, rows_product_reference
from moed.kernels.native_cpu import native
from moed.kernels.native_cpu_reference import quantize_activations

X8_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q4_K, T.Q5_K, T.IQ4_XS, T.MXFP4, T.NVFP4]
SUPER = (T.Q4_K, T.Q5_K, T.IQ4_XS)  # 256-weight super-blocks
BIT_PACKED = (T.Q4_K, T.Q5_K, T.IQ4_XS, T.Q5_0, T.Q5_1)  # scales or fifth bits re-packed bit for bit


def _ks(qtype: T, ks: tuple[int, ...]) -> tuple[int, ...]:
    """Odd K of 32-weight blocks -> the same for qtype's block size (256: super-blocks, 64: NVFP4)."""
    if qtype in SUPER:
        return (256, 1280)[:len(ks)] if len(ks) > 1 else (256,)
    return tuple(2 * k for k in ks) if qtype == T.NVFP4 else ks


def _lib():
    lib = native()
    if lib is None:
        pytest.skip("the native CPU kernels are not built")
    return lib


def _rows(qtype: T, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    data = random_blocks(qtype, (rows, k), np.random.default_rng(seed))
    if qtype == T.MXFP4:  # exponents near 2^0 as real files have, and the subnormal two (0, 1)
        data = data.reshape(-1, 17)
        data[:, 0] = np.random.default_rng(seed).integers(118, 130, size=data.shape[0])
        data[:2, 0] = (0, 1)
    if qtype == T.NVFP4:  # subnormal scales, 0x7F (reads as 0) and 0xFF (240: bit 7 ignored) among them
        data = data.reshape(-1, 36)
        data[:3, :4] = [[0, 1, 7, 0x7F], [0xFF, 0x87, 8, 0x80], [5, 0x7E, 0xFE, 3]]
    return torch.from_numpy(np.ascontiguousarray(data).reshape(rows, -1))


@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
def test_packing_is_a_lossless_permutation_and_native_matches_the_twin(qtype):
    lib = _lib()
    for k in _ks(qtype, (32, 96, 224)):
        valid = _rows(qtype, 24, k)
        noise = torch.randint(0, 256, valid.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
        for raw in (valid, noise):  # any bytes: Q4_K's 6-bit scales re-packed bit for bit
            packed = x8.pack(raw, int(qtype), k)
            assert packed.shape == raw.shape
            assert torch.equal(torch.sort(packed.view(-1))[0], torch.sort(raw.view(-1))[0]) or qtype in BIT_PACKED
            assert torch.equal(x8.unpack(packed, x8.X8_OF[int(qtype)], k), raw)
            native_packed = lib.ggml_x8_convert(raw, int(qtype), k, pack=True)
            assert torch.equal(native_packed, packed)
            assert torch.equal(lib.ggml_x8_convert(native_packed, x8.X8_OF[int(qtype)], k, pack=False), raw)
        # the decode of an x8 matrix is gguf's decode of its rows
        assert torch.equal(dequantize_rows(x8.pack(valid, int(qtype), k), x8.X8_OF[int(qtype)], k),
                           dequantize_rows(valid, int(qtype), k))


def test_bad_packing_arguments_are_refused():
    lib = _lib()
    raw = _rows(T.Q4_0, 12, 64)
    with pytest.raises(ValueError, match="8n"):
        x8.pack(raw, int(T.Q4_0), 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        lib.ggml_x8_convert(raw, int(T.Q4_0), 64, pack=True)
    with pytest.raises(ValueError, match="x8 layout"):
        x8.pack(_rows(T.Q6_K, 8, 256), int(T.Q6_K), 256)
    with pytest.raises(ValueError, match="contiguous uint8 tensor"):
        r8 = _rows(T.Q4_0, 16, 64)
        lib.ggml_x8_convert(r8, int(T.Q4_0), 64, pack=True, out=r8[::2])


@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
def test_in_place_conversion_equals_the_copy(qtype):
    lib = _lib()
    k = _ks(qtype, (96,))[0]
    raw = _rows(qtype, 8 * 3000, k)  # more than one task (~1 MB each) of groups
    want = x8.pack(raw, int(qtype), k)
    t = raw.clone()
    assert lib.ggml_x8_convert(t, int(qtype), k, pack=True, out=t) is t
    assert torch.equal(t, want)
    lib.ggml_x8_convert(t, x8.X8_OF[int(qtype)], k, pack=False, out=t)
    assert torch.equal(t, raw)


@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
def test_x8_kernels_match_the_torch_twin_at_every_isa(qtype):
    lib = _lib()
    x8_type = x8.X8_OF[int(qtype)]
    for k in _ks(qtype, (32, 160, 2080)):
        raw = _rows(qtype, 16, k, seed=k)
        x = torch.randn(3, k) * torch.linspace(0.1, 3.0, k)
        want, bound = rows_product_reference(raw, int(qtype), k, x)
        xq, xs, xsum = quantize_activations(x, act_span(qtype))
        packed = lib.ggml_x8_convert(raw, int(qtype), k, pack=True)
        for isa in lib.available_isas():
            got = torch.cat([lib.ggml_dot8_one(x8_type, isa, packed[8 * g:8 * g + 8], xq, xs, xsum.float())
                             for g in range(2)], dim=1)
            err = ((got.double() - want).abs() / bound.clamp_min(1e-30)).max().item()
            assert err < 1e-5, (qtype.name, k, isa, err)
        # all-zero activations: no division by their zero scale
        zq, zs, zsum = quantize_activations(torch.zeros(1, k), act_span(qtype))
        for isa in lib.available_isas():
            assert torch.equal(lib.ggml_dot8_one(x8_type, isa, packed[:8], zq, zs, zsum.float()), torch.zeros(1, 8))


def _bank(types: dict[str, T], experts: int = 6, hidden: int = 512, inter: int = 256, relu2: bool = False,
          seed: int = 0) -> ExpertBank:
    tensors, row_types = {}, {}
    for layer, (gt, dt) in enumerate(types.items()):
        gtype, dtype = T[gt], dt
        gate = _rows(gtype, experts * inter, hidden, seed + layer).view(experts, inter, -1)
        up = gate if relu2 else _rows(gtype, experts * inter, hidden, seed + 10 + layer).view(experts, inter, -1)
        down = _rows(dtype, experts * hidden, inter, seed + 20 + layer).view(experts, hidden, -1)
        for kind, t, qt in (("gate", gate, gtype), ("up", up, gtype), ("down", down, dtype)):
            tensors[f"{kind}.{layer}"], row_types[f"{kind}.{layer}"] = t, int(qt)
    return ExpertBank(num_moe_layers=len(types), num_experts=experts, hidden_size=hidden, intermediate_size=inter,
                      dtype=GGML_BANK, activation=ExpertActivation("relu2" if relu2 else "silu"), tensors=tensors,
                      row_types=row_types)


def _clone(bank: ExpertBank) -> ExpertBank:
    same: dict[int, torch.Tensor] = {}
    tensors = {n: same.setdefault(id(t), t.clone()) for n, t in bank.tensors.items()}
    return ExpertBank(num_moe_layers=bank.num_moe_layers, num_experts=bank.num_experts, hidden_size=bank.hidden_size,
                      intermediate_size=bank.intermediate_size, dtype=bank.dtype, activation=bank.activation,
                      tensors=tensors, row_types=dict(bank.row_types))


def test_a_bank_laid_out_for_the_cpu_runs_as_stored(monkeypatch):
    lib = _lib()
    if not lib.ggml_x8_preferred(int(T.Q4_K)):
        pytest.skip("the x8 kernels are not this CPU's faster ones")
    # layer 0: Q4_K gate/up with a Q6_K down (a Q4_K_M file's mix: the down stays rows); layer 1: Q4_0 / Q4_K;
    # layer 2: MXFP4 (gpt-oss); layer 3: IQ4_XS / Q5_K (a UD mix); layer 4: Q4_1 / IQ4_NL; layer 5: NVFP4;
    # layer 6: Q5_0 / Q5_1
    stored = _bank({"Q4_K": T.Q6_K, "Q4_0": T.Q4_K, "MXFP4": T.MXFP4, "IQ4_XS": T.Q5_K, "Q4_1": T.IQ4_NL,
                    "NVFP4": T.NVFP4, "Q5_0": T.Q5_1})
    bank = _clone(stored)
    converted = interleave_for_cpu(bank)
    want = {"gate.0": T.Q4_K, "up.0": T.Q4_K, "gate.1": T.Q4_0, "up.1": T.Q4_0, "down.1": T.Q4_K,
            "gate.2": T.MXFP4, "up.2": T.MXFP4, "down.2": T.MXFP4, "gate.3": T.IQ4_XS, "up.3": T.IQ4_XS,
            "down.3": T.Q5_K, "gate.4": T.Q4_1, "up.4": T.Q4_1, "down.4": T.IQ4_NL, "gate.5": T.NVFP4,
            "up.5": T.NVFP4, "down.5": T.NVFP4, "gate.6": T.Q5_0, "up.6": T.Q5_0, "down.6": T.Q5_1}
    assert converted == {name: x8.X8_OF[int(t)] for name, t in want.items()}
    assert bank.row_types["down.0"] == int(T.Q6_K)
    assert interleave_for_cpu(bank) == {}  # already laid out
    for name, t in bank.tensors.items():
        k = bank.hidden_size if not name.startswith("down") else bank.intermediate_size
        assert torch.equal(dequantize_rows(t.view(-1, t.shape[-1]), bank.row_types[name], k),
                           dequantize_rows(stored.tensors[name].view(-1, t.shape[-1]), stored.row_types[name], k))
    gen = torch.Generator().manual_seed(1)
    for n in (1, 3, 40):  # decode rows; the int8 kernels on several tokens; the bf16 prefill GEMMs
        hidden = torch.randn(n, bank.hidden_size, generator=gen)
        for layer in range(bank.num_moe_layers):
            ids = torch.randint(0, bank.num_experts, (n, 4), generator=gen, dtype=torch.int32) + layer * bank.num_experts
            ids[0, 3] = -1  # a slot not run here
            weights = torch.rand(n, 4, generator=gen)
            _, want = run_routed(stored, hidden, ids, weights)
            _, got = run_routed(bank, hidden, ids, weights)
            # the two kernels sum in different orders: an intermediate activation can round to the neighbouring
            # int8 code before the down matrix (one step of its group's scale, ~1e-4 of the largest output)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item()), (n, layer)
    # the bf16 prefill GEMMs (CPUs with native bf16: rows decoded once per expert): the same decoded rows
    x = torch.randn(20, bank.hidden_size, generator=gen)
    for fid in (0, bank.num_experts + 1, 2 * bank.num_experts + 2, 3 * bank.num_experts + 3, 4 * bank.num_experts,
                5 * bank.num_experts + 5, 6 * bank.num_experts + 1):
        assert torch.equal(ggml_expert_gemm(bank, fid, x), ggml_expert_gemm(stored, fid, x))
    # a device's slots read GGUF rows: an interleaved bank is refused with the way out
    with pytest.raises(ValueError, match="interleaved for the CPU kernels"):
        slot_layout(bank)


def test_relu2_experts_convert_their_shared_matrix_once():
    lib = _lib()
    if not lib.ggml_x8_preferred(int(T.Q4_0)):
        pytest.skip("the x8 kernels are not this CPU's faster ones")
    stored = _bank({"Q4_0": T.Q4_0}, relu2=True)
    bank = _clone(stored)
    assert bank.tensors["gate.0"] is bank.tensors["up.0"]
    interleave_for_cpu(bank)
    assert bank.row_types["gate.0"] == bank.row_types["up.0"] == x8.X8_OF[int(T.Q4_0)]
    assert torch.equal(bank.tensors["up.0"], lib.ggml_x8_convert(stored.tensors["up.0"], int(T.Q4_0), 512, pack=True))
    hidden = torch.randn(2, 512)
    ids = torch.tensor([[0, 5], [2, 3]], dtype=torch.int32)
    _, want = run_routed(stored, hidden, ids, torch.ones(2, 2))
    _, got = run_routed(bank, hidden, ids, torch.ones(2, 2))
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_the_cpu_executor_lays_the_bank_out_and_the_switch_keeps_rows(monkeypatch):
    lib = _lib()
    if not lib.ggml_x8_preferred(int(T.Q4_K)):
        pytest.skip("the x8 kernels are not this CPU's faster ones")
    bank = _bank({"Q4_K": T.Q4_K})
    build_executor(bank, EngineConfig(device="cpu")).close()
    assert all(x8.is_x8(t) for t in bank.row_types.values())
    monkeypatch.setenv(cpu_layout.X8_ENV, "0")
    kept = _bank({"Q4_K": T.Q4_K})
    build_executor(kept, EngineConfig(device="cpu")).close()
    assert not any(x8.is_x8(t) for t in kept.row_types.values())
    # a device keeps the rows its slots read
    monkeypatch.delenv(cpu_layout.X8_ENV)
    dev = _bank({"Q4_K": T.Q4_K})
    build_executor(dev, EngineConfig(device="emulated")).close()
    assert not any(x8.is_x8(t) for t in dev.row_types.values())


def test_row_sizes_and_names_of_the_x8_types():
    for qtype in X8_TYPES:
        x8_type = x8.X8_OF[int(qtype)]
        assert x8.base_type(x8_type) == int(qtype) and x8.base_type(int(qtype)) == int(qtype)
        assert row_bytes(x8_type, 256) == row_bytes(int(qtype), 256)
        assert act_span(x8_type) == act_span(int(qtype))
        assert x8.type_name(x8_type) == f"{qtype.name}_x8"


@pytest.mark.parametrize("qtype", X8_TYPES, ids=lambda t: t.name)
def test_x8_many_tokens_in_one_call_are_each_the_one_token_result(qtype):
    """Prefill calls an x8 group with many tokens (Q4_K / Q5_K take them four at a time, sharing the decoded codes
    and scales): every token's eight outputs are bit for bit its one-token call's, at every count from 1 to 9."""
    lib = _lib()
    x8_type = x8.X8_OF[int(qtype)]
    k = _ks(qtype, (160,))[0]
    packed = lib.ggml_x8_convert(_rows(qtype, 8, k, seed=3), int(qtype), k, pack=True)
    x = torch.randn(9, k) * torch.linspace(0.1, 3.0, k)
    xq, xs, xsum = quantize_activations(x, act_span(qtype))
    xsum = xsum.float()
    for isa in lib.available_isas():
        one = torch.cat([lib.ggml_dot8_one(x8_type, isa, packed, xq[t:t + 1], xs[t:t + 1], xsum[t:t + 1])
                         for t in range(9)])
        for n in range(2, 10):
            assert torch.equal(lib.ggml_dot8_one(x8_type, isa, packed, xq[:n], xs[:n], xsum[:n]), one[:n]), (isa, n)
