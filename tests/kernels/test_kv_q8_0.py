"""q8_0 K/V (--kv-type q8_0): llama.cpp's Q8_0 blocks in the paged pool.

The torch reference (cache/q8_0.py) against the gguf package's published Q8_0 quantiser and
dequantiser; the pool's writes and reads through it; the native decode kernel's writes bit for bit
against the reference (its float16 rounding of the scales included, subnormal ones too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moed.cache import q8_0
from moed.cache.kv_cache import KVCache, kv_bytes_per_token
from moed.kernels.native_cpu import native
from moed.runner.forward_batch import ForwardBatch

gguf = pytest.importorskip("gguf")


def _values(gen: torch.Generator, rows: int, dim: int) -> torch.Tensor:
    x = torch.randn(rows, dim, generator=gen) * torch.logspace(-7, 4, rows)[:, None]  # subnormal to large scales
    x[0] = 0.0  # an all-zero block: d = 0, q = 0
    x[1, :32] = torch.arange(-16, 16) + 0.5  # with a maximum of 127, d = 1: exact halves, ties away from zero
    x[1, 31] = -127.0
    x[2, 5] = 127.0  # the block's maximum maps to 127 exactly
    return x


def _gguf_split(raw: np.ndarray, rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = raw.reshape(rows, dim // 32, 34)
    return (blocks[..., 2:].copy().view(np.int8).reshape(rows, dim),
            blocks[..., :2].copy().view(np.float16).reshape(rows, dim // 32))


def test_the_reference_is_the_gguf_packages_q8_0():
    x = _values(torch.Generator().manual_seed(0), 40, 128)
    q, d = q8_0.quantize(x)
    raw = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    want_q, want_d = _gguf_split(raw, 40, 128)
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(d.numpy(), want_d)
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(q8_0.dequantize(q, d).numpy(), back)
    with pytest.raises(ValueError, match="multiple of 32.*--kv-type bf16"):
        q8_0.check_row_size("k", 48)


def test_a_q8_0_pool_stores_blocks_and_reads_them_back():
    gen = torch.Generator().manual_seed(1)
    entries = [{"k": (2, 64), "v": (2, 64)}, {"latent": (512,), "k_rot": (64,)}]
    cache = KVCache(entries, num_blocks=8, block_size=4, dtype=torch.int8)
    assert cache.quantized and cache.entry(0, "k").dtype == torch.int8
    assert cache.entry_scale(0, "k").shape == (8, 4, 2, 2) and cache.entry_scale(1, "latent").shape == (8, 4, 16)
    # 8.5 bits per value: an int8 each and a float16 per 32
    assert cache.nbytes() == 8 * 4 * (2 * 128 + 576) * 34 // 32
    assert kv_bytes_per_token(entries, torch.int8) == (2 * 128 + 576) * 34 // 32
    batch = ForwardBatch.from_token_lists([[1] * 6, [2] * 3], [0, 5], [0, 1], [[3, 1], [6, 0]], packed=True)
    k = torch.randn(1, 9, 2, 64, generator=gen)
    cache.write(0, "k", k, batch)
    want = q8_0.dequantize(*q8_0.quantize(k[0]))
    torch.testing.assert_close(cache.read_range(0, "k", batch, 0, 0, 6), want[:6], rtol=0, atol=0)
    torch.testing.assert_close(cache.read_range(0, "k", batch, 1, 5, 8), want[6:], rtol=0, atol=0)
    assert cache.read_range(0, "k", batch, 0, 2, 5, torch.bfloat16).dtype == torch.bfloat16
    # a resize keeps values and scales
    cache.resized(12, [])
    torch.testing.assert_close(cache.read_range(0, "k", batch, 0, 0, 6), want[:6], rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache([{"k": (2, 48)}], num_blocks=2, block_size=4, dtype=torch.int8)


@pytest.mark.skipif(native() is None, reason="native CPU kernels not built")
def test_the_native_kernel_writes_the_references_bits(isa):
    """No norm, no rotation: the kernel stores k and v as given, so its int8 values and float16 scales must be
    the reference's exactly (roundf, and float16 round-to-nearest-even down to subnormal scales)."""
    lib = native()
    gen = torch.Generator().manual_seed(2)
    rows, dim = 24, 64
    k, v = _values(gen, rows, dim), _values(gen, rows, dim).flip(0).contiguous()
    pool = lambda: torch.zeros(rows, 1, 1, dim, dtype=torch.int8)  # noqa: E731  one token per block
    scales = lambda: torch.zeros(rows, 1, 1, dim // 32, dtype=torch.float16)  # noqa: E731
    k_cache, v_cache, k_scale, v_scale = pool(), pool(), scales(), scales()
    lib.attn_decode(torch.zeros(rows, dim), k, v, num_heads=1, num_kv_heads=1, q_norm=None, k_norm=None, eps=1e-6,
                    rot_dim=0, interleaved=False, cos=torch.zeros(rows, 0), sin=torch.zeros(rows, 0), k_cache=k_cache,
                    v_cache=v_cache, block_tables=torch.arange(rows, dtype=torch.int32)[:, None],
                    starts=[0] * rows, positions=[0] * rows, lengths=[1] * rows, num_keys=1, window=None, scale=1.0,
                    sinks=None, k_scale=k_scale, v_scale=v_scale)
    for got_q, got_d, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        want_q, want_d = q8_0.quantize(x)
        assert torch.equal(got_q.reshape(rows, dim), want_q)
        assert torch.equal(got_d.reshape(rows, -1).view(torch.int16), want_d.view(torch.int16))
    assert (k_scale.float() < 2 ** -14).any() and (k_scale > 0).any()  # subnormal scales were exercised
