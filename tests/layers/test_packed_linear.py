"""PackedLinear: quantised GGUF linear() weights kept packed (q8 / int4) and multiplied natively.

(a) ``matmul`` against float64 on the dequantised weight, within the native kernel's stated bound
(int8 activations per 32 along K); (b) a Q8_0 GGUF loads its attention and lm_head weights packed,
bit for bit what ``gguf.quants`` decodes, with logits close to the same file in fp32; (c) an
explicit weights dtype still dequantises; the load estimate counts the packed bytes exactly.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import write_tiny_gguf
from moed.engine.runtime import open_runtime
from moed.kernels.int4_format import quantize_int4
from moed.kernels.native_cpu import MAX_TOKENS, native
from moed.kernels.q8_format import quantize_q8
from moed.layers import packed_linear as pl
from moed.layers.linear import linear, linear_f32
from moed.layers.packed_linear import PackedLinear, packed_nbytes, weight_nbytes
from moed.models.decode_chain import DecodeChain
from moed.runner.forward_batch import ForwardBatch
from moed.weights.gguf_checkpoint import GgufCheckpoint
from moed.weights.model_loader import estimate_load

K, N = 256, 96
TOKENS = (1, 3, 16, 40)  # 40 > MAX_TOKENS: the dequantise + float32 path
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _packed(dtype: str, seed: int = 0) -> PackedLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(K, N, generator=g) * 0.05
    arrays = quantize_q8(w) if dtype == "q8" else quantize_int4(w)
    return PackedLinear.from_kn(dtype, tuple(arrays), K, N)


def _bound(x: torch.Tensor, w: torch.Tensor, *, native_path: bool) -> torch.Tensor:
    """Per output ``[T, N]``: the native kernel rounds each activation to ``xq * xs_g`` with
    ``xs_g = max|x_g| / 127`` over its group g of 32 along K, so ``|x - xq xs_g| <= xs_g / 2`` and

        |y_native - y_exact| <= sum_g (xs_g / 2) sum_{k in g} |w[k, n]|  +  1e-5 sum_k |x[t, k] w[k, n]|

    (the second term: float32 accumulation and scale products). The float32 torch path (a few rows
    without the library) has only the second term; the prefill path (more than MAX_TOKENS rows) is a
    bf16 GEMM: activations and weights each rounded to bf16 (relative 2^-9 each), so 2^-8 per term."""
    xd, wd = x.double(), w.double()
    slack = 1e-5 * (xd.abs() @ wd.abs())
    if not native_path:
        return slack + (2.0**-8 * (xd.abs() @ wd.abs()) if x.shape[0] > MAX_TOKENS else 0)
    xs = xd.view(x.shape[0], K // 32, 32).abs().amax(dim=-1) / 127.0  # [T, K/32]
    wg = wd.abs().view(K // 32, 32, N).sum(dim=1)  # [K/32, N]
    return (xs / 2) @ wg + slack


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", ["q8", "int4"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_matmul_is_within_the_activation_rounding_bound(dtype, tokens, use_native, monkeypatch):
    if use_native and native() is None:
        pytest.skip("native kernels not built")
    if not use_native:
        monkeypatch.setattr(pl, "native", lambda: None)
    weight = _packed(dtype, seed=tokens)
    x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(100 + tokens))
    w = weight.dequantize(torch.float32).t()  # [K, N]
    exact = x.double() @ w.double()
    y = weight.matmul(x)
    assert y.dtype == torch.float32 and tuple(y.shape) == (tokens, N)
    bound = _bound(x, w, native_path=use_native and tokens <= MAX_TOKENS)
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


def test_linear_takes_a_packed_weight_with_leading_dims_and_bias(monkeypatch):
    weight = _packed("q8")
    x = torch.randn(2, 3, K)
    bias = torch.randn(N)
    y = linear(x, weight, bias)
    assert tuple(y.shape) == (2, 3, N)
    assert torch.allclose(y, weight.matmul(x.reshape(6, K)).view(2, 3, N) + bias)
    assert torch.allclose(linear_f32(x, weight, bias), y)
    monkeypatch.setattr(pl, "native", lambda: None)  # without the C library: the torch path
    ref = x @ weight.dequantize(torch.float32).t() + bias
    assert torch.allclose(linear(x, weight, bias), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["q8", "int4"])
def test_shape_bytes_and_dequantize(dtype):
    weight = _packed(dtype)
    assert tuple(weight.shape) == (N, K) and weight.in_features == K and weight.out_features == N
    assert weight.nbytes() == weight_nbytes(weight) == packed_nbytes(dtype, K, N)
    assert packed_nbytes(dtype, K, N) == (K * N + K // 32 * N * 2 if dtype == "q8" else K * N // 2 + K // 32 * N * 4)
    bf = weight.dequantize()
    assert bf.dtype == torch.bfloat16 and tuple(bf.shape) == (N, K)
    assert torch.equal(bf, weight.dequantize(torch.float32).to(torch.bfloat16))
    # the native decoders (prefill on CPUs without bf16 GEMMs) give the torch decoders' values
    assert torch.equal(weight.dequantize_f32(), weight.dequantize(torch.float32))
    assert torch.equal(weight.dequantize_bf16(), bf)
    with pytest.raises(ValueError, match="N even"):
        PackedLinear(dtype, weight.arrays, K, N + 1)
    with pytest.raises(ValueError, match="array should be"):  # k-major arrays are not the rows layout
        PackedLinear(dtype, tuple(quantize_q8(torch.randn(K, N)) if dtype == "q8" else quantize_int4(torch.randn(K, N))),
                     K, N)


def test_q_k_v_in_one_call_equal_one_by_one():
    if native() is None:
        pytest.skip("native kernels not built")
    for dtype in ("q8", "int4"):
        weights = tuple(_packed(dtype, seed=s) for s in range(3))
        x = torch.randn(2, K)
        many = PackedLinear.matmul_many(weights, x)
        for got, w in zip(many, weights):
            assert torch.equal(got, w.matmul(x))


# ---- GGUF loading ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "gpt_oss"])
def q8_gguf(request, tmp_path_factory):
    path, _, _ = write_tiny_gguf(request.param, tmp_path_factory.mktemp("q8"), expert_type=T.Q8_0,
                                 weight_type=T.Q8_0, tie_word_embeddings=False)
    return path


def _reference(path) -> dict[str, torch.Tensor]:
    """gguf.quants' own dequantisation of every tensor, float32 in numpy order."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                                              dtype=np.float32)) for t in reader.tensors}


def test_a_q8_0_gguf_loads_attention_and_lm_head_packed_bit_for_bit(q8_gguf):
    gg = GgufCheckpoint(q8_gguf)
    ref = _reference(q8_gguf)
    runtime = open_runtime(q8_gguf)
    try:
        weights = runtime.loaded.weights
        packed = {name for name, t in weights.items() if isinstance(t, PackedLinear)}
        layers = gg.config.num_layers
        want = {f"model.layers.{i}.self_attn.{p}.weight" for i in range(layers) for p in ATTENTION}
        want |= {"lm_head.weight", "model.embed_tokens.weight"}  # the embedding too, looked up a row at a time
        if gg.config.moe.shared_intermediate_size:  # qwen2_moe's shared expert (its [1, D] gate is not packed)
            want |= {f"model.layers.{i}.mlp.shared.{p}_proj.weight" for i in range(layers) for p in ("gate", "up", "down")}
            assert isinstance(weights["model.layers.0.mlp.shared_gate.weight"], torch.Tensor)
        assert packed == want
        for name in packed:
            t = weights[name]
            assert t.dtype == "q8" and tuple(t.shape) == gg.weight_shapes()[name]
            assert torch.equal(t.dequantize(torch.float32), ref[gg.weight_keys[name]].reshape(t.shape)), name
        # a looked-up row is the file's row, decoded exactly; norms and the (F32) routers load as tensors
        embed, ids = weights["model.embed_tokens.weight"], torch.tensor([[3, 0], [7, 3]])
        want_rows = ref[gg.weight_keys["model.embed_tokens.weight"]].reshape(embed.shape)[ids]
        assert torch.equal(embed.take_rows(ids), want_rows)
        assert weights["model.layers.0.mlp.router.weight"].dtype == torch.float32
        # the packed arrays are the file's Q8_0 blocks, row by row as in the file: d and qs exactly
        name = "model.layers.0.self_attn.q_proj.weight"
        qs, d = weights[name].arrays
        info = gg.file.tensor(gg.weight_keys[name])
        blocks = gg.file.read(info.name).view(info.shape[0], info.shape[1] // 32, 34)  # [N, K/32, 34]
        assert torch.equal(d, blocks[..., :2].contiguous().view(torch.float16).squeeze(-1))
        assert torch.equal(qs, blocks[..., 2:].contiguous().view(torch.int8).reshape(info.shape))
    finally:
        runtime.close()


def _logits(runtime, prompt: list[int]) -> torch.Tensor:
    """Logits of every position of ``prompt`` (one prefill step) and of one decode step after it."""
    model = runtime.model
    cache = model.new_cache(1, 64)
    prefill = model.forward(ForwardBatch.from_token_lists([prompt], [0], [0]), cache, last_only=False)[0]
    decode = model.forward(ForwardBatch.from_token_lists([[prompt[0]]], [len(prompt)], [0]), cache)
    return torch.cat([prefill, decode])


# Q8_0 weights are the same in both loads; only the packed path's int8 activations (per 32, as
# llama.cpp's Q8 activations) differ from float32: well under 1% of the logits' range at a typical
# position of these tiny models (weights scaled up 4x). A position whose top-k routing is a near tie
# can flip experts and differ by more (seen: 18% of the range at one position in 37, and up to 8% of
# the positions of a prompt set above 3%), so the typical position is held to PACKED_TOL, most
# positions to NEAR_TOL and every position only to the looser FLIP_TOL.
PACKED_TOL = 2e-2  # the median position (seen: <= 0.75%)
NEAR_TOL, NEAR_SHARE = 3e-2, 0.75  # at least this share of the positions within NEAR_TOL (seen: >= 92%)
FLIP_TOL = 0.5


def test_packed_logits_stay_close_to_the_fp32_load(q8_gguf):
    fp32 = open_runtime(q8_gguf, weights_dtype="fp32")
    packed = open_runtime(q8_gguf)
    try:
        assert not any(isinstance(t, PackedLinear) for t in fp32.loaded.weights.values())
        assert any(isinstance(t, PackedLinear) for t in packed.loaded.weights.values())
        gen = torch.Generator().manual_seed(5)
        errors = []  # per position, relative to the logits' range
        for length in (1, 9, MAX_TOKENS + 8):  # native rows, and more rows than the native path takes
            prompt = torch.randint(3, 500, (length,), generator=gen).tolist()
            want, got = _logits(fp32, prompt), _logits(packed, prompt)
            errors.append((got - want).abs().amax(dim=-1) / max(1.0, float(want.abs().max())))
        errors = torch.cat(errors)
        assert float(errors.median()) <= PACKED_TOL, errors
        assert float((errors <= NEAR_TOL).float().mean()) >= NEAR_SHARE, errors
        assert float(errors.max()) <= FLIP_TOL, errors
    finally:
        fp32.close()
        packed.close()


def test_an_explicit_weights_dtype_still_dequantises(q8_gguf):
    gg = GgufCheckpoint(q8_gguf)
    runtime = open_runtime(q8_gguf, weights_dtype="fp32")
    try:
        weights = runtime.loaded.weights
        assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in weights.values())
        name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(weights[name], gg.read_packed_weight(name).dequantize(torch.float32))
        # read_weight (moed convert, an explicit dtype) is unchanged: quantised -> bf16
        assert gg.weight_dtype(name) == torch.bfloat16 and gg.read_weight(name).dtype == torch.bfloat16
    finally:
        runtime.close()


@pytest.mark.parametrize("weights_dtype", ["auto", "fp32"])
def test_the_estimate_counts_the_packed_bytes_the_load_allocates(q8_gguf, weights_dtype):
    est = estimate_load(q8_gguf, None, weights_dtype)
    runtime = open_runtime(q8_gguf, weights_dtype=weights_dtype)
    try:
        assert est.weight_bytes == sum(weight_nbytes(t) for t in runtime.loaded.weights.values())
        assert est.bank_bytes == runtime.loaded.bank.nbytes()
    finally:
        runtime.close()


KEPT_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4,
              T.NVFP4]


@pytest.mark.parametrize("weight_type", KEPT_TYPES, ids=lambda v: v.name)
def test_quantised_linears_keep_their_gguf_type_block_for_block(tmp_path, weight_type):
    """Every GGUF type the ggml kernels read loads as its own rows, byte for byte (the values gguf decodes,
    exactly), runs through the decode chain, and the estimate counts its bytes."""
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q8_0, weight_type=weight_type,
                                 hidden_size=256, head_dim=64)
    gg = GgufCheckpoint(path)
    ref = _reference(path)
    name = "model.layers.0.self_attn.o_proj.weight"
    assert gg.packed_weight_dtype(name) == weight_type.name.lower()
    t = gg.read_packed_weight(name)
    assert t.dtype == weight_type.name.lower() and t.ggml_type == int(weight_type)
    src = ref[gg.weight_keys[name]].reshape(t.shape)
    assert torch.equal(t.dequantize(torch.float32), src.float())
    if native() is not None:  # the prefill GEMMs' float32 weights (CPUs without bf16 GEMMs), decoded natively
        assert torch.equal(t.dequantize_f32(), src.float())
    changes = [line for line in gg.type_changes() if "token_embd" not in line]  # the embedding: bf16 rows
    assert not changes, changes  # no linear re-quantised: no warning
    runtime = open_runtime(path)
    try:
        weights = runtime.loaded.weights
        assert isinstance(weights[name], PackedLinear) and weights[name].dtype == weight_type.name.lower()
        if native() is not None:  # the native decode chain takes GGUF rows
            assert isinstance(runtime.model.decode_chain(), DecodeChain), runtime.model.decode_chain()
        assert est_equals_load(path, runtime)
    finally:
        runtime.close()


def test_a_type_the_kernels_do_not_read_is_requantised_to_q8_and_said(tmp_path):
    """IQ2_XS has no moed kernel: its linears are decoded (gguf's reference) and re-quantised to q8, within
    half a q8 step, and type_changes names them."""
    path, _, _ = write_tiny_gguf("qwen3_moe", tmp_path, expert_type=T.Q8_0, weight_type=T.IQ2_XS,
                                 hidden_size=256, head_dim=64)
    gg = GgufCheckpoint(path)
    ref = _reference(path)
    name = "model.layers.0.self_attn.o_proj.weight"
    assert gg.packed_weight_dtype(name) == "q8"
    t = gg.read_packed_weight(name)
    src = ref[gg.weight_keys[name]].reshape(t.shape)
    got = t.dequantize(torch.float32)
    amax = src.view(src.shape[0], -1, 32).abs().amax(dim=-1, keepdim=True)
    assert bool(((got - src).abs().view_as(amax.expand(-1, -1, 32)) <= amax / 127 * 0.5 * 1.001 + 1e-12).all())
    changes = gg.type_changes()
    assert any("IQ2_XS" in line and "re-quantised to q8" in line for line in changes), changes


def est_equals_load(path, runtime) -> bool:
    return estimate_load(path).weight_bytes == sum(weight_nbytes(t) for t in runtime.loaded.weights.values())


def test_linear_many_equals_linear_one_by_one():
    """q, k and v through linear_many (one native call for bf16 or packed weights) give linear's bits."""
    from moed.layers.linear import linear_many

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 1, K, generator=gen)
    bf16 = tuple(torch.randn(n, K, generator=gen).bfloat16() for n in (64, 32, 32))
    packed = tuple(_packed(dtype, seed=s) for s, dtype in enumerate(("int4", "int4", "int4")))
    mixed = (bf16[0], packed[1], torch.randn(N, K, generator=gen))
    for weights in (bf16, packed, mixed):
        biases = (torch.randn(weights[0].shape[0], generator=gen), None, None)
        many = linear_many(x, weights, biases)
        for got, w, b in zip(many, weights, biases):
            want = linear(x, w, b)
            assert got.shape == want.shape == (2, 1, w.shape[0])
            assert torch.equal(got, want)
