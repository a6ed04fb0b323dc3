"""Llama-4's parts against transformers and against their own oracles: chunked local attention (paged, native
decode, a prefix resumed from cached blocks inside a later chunk), NoPE layers with the query temperature, the
multimodal checkpoint's language model, the emulated device, and the configs moed refuses."""

from __future__ import annotations

import pytest
import torch

import moed.layers.paged_attention as paged
from helpers.reference_parity import assert_emulated_device_matches, assert_multimodal_language_model, random_prompt
from helpers.tiny_models import build_tiny_model, tiny_config
from moed.engine.runtime import open_runtime
from moed.errors import ModelFormatError, UnsupportedModelError
from moed.kernels.native_cpu import native
from moed.models.families import parse_model_config
from moed.runner.forward_batch import ForwardBatch


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    return path, build_tiny_model("llama4_text", path)




def test_the_config_maps_to_chunks_nope_layers_and_input_weighted_experts(llama4):
    path, _ = llama4
    config = open_runtime(path).model.config
    assert config.attention_chunks == (8, 8, None, 8) and config.nope_layers == (False, False, True, False)
    assert config.moe_layers == (True, False, True, True) and config.dense_intermediate_size == 96
    assert config.moe.top_k == 1 and config.moe.weight_input and config.moe.shared_intermediate_size == 64
    assert config.attention.qk_norm == "weightless" and config.attention.nope_temperature == (4.0, 0.25)
    assert config.rope.interleaved and config.rope.rope_type == "llama3"


@pytest.mark.parametrize("start,n,chunk,window", [(0, 37, 8, None), (5, 30, 8, None), (13, 1, 8, None),
                                                  (16, 1, 8, None), (40, 20, 16, 6), (0, 70, 64, None)])
def test_chunked_paged_attention_equals_the_dense_oracle(start, n, chunk, window, monkeypatch):
    monkeypatch.setattr(paged, "KEY_BLOCK", 16)  # several key blocks, some across a chunk boundary
    monkeypatch.setattr(paged, "QUERY_TILE", 8)
    gen = torch.Generator().manual_seed(start * 100 + n)
    heads, kv_heads, dim, total = 4, 2, 16, start + n
    q = torch.randn(1, heads, n, dim, generator=gen)
    keys, values = torch.randn(kv_heads, total, dim, generator=gen), torch.randn(kv_heads, total, dim, generator=gen)
    read = lambda seq, j0, j1: (keys[:, j0:j1], values[:, j0:j1])  # noqa: E731
    got = paged.attend_paged(q, read, [start], [n], 0.25, value_dim=dim, chunk=chunk, window=window)
    mask = paged.dense_mask([start], [n], n, total, window, chunk)
    want = paged.attend_dense(q, keys[None], values[None], mask, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(mask, paged.dense_mask([start], [n], n, total, window)) or total <= chunk


@pytest.mark.skipif(native() is None, reason="no native kernels")
@pytest.mark.parametrize("positions", [[3, 8, 15, 16, 23], [0, 7, 9, 31, 40]])
def test_the_native_decode_kernel_sees_the_chunk_of_each_row(positions):
    """One new token per row at its own position: the kernel's visible keys are its row's chunk, as the paged torch
    path computes them (the rows' chunks start at different places)."""
    lib = native()
    rows, heads, kv_heads, dim, block, chunk = len(positions), 4, 2, 32, 16, 8
    gen = torch.Generator().manual_seed(sum(positions))
    max_blocks = (max(positions) + 1 + block - 1) // block
    k_cache = torch.randn(rows * max_blocks, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(rows * max_blocks, block, kv_heads, dim, generator=gen)
    tables = torch.arange(rows * max_blocks, dtype=torch.int32).view(rows, max_blocks)
    q = torch.randn(rows, heads * dim, generator=gen)
    k, v = torch.randn(rows, kv_heads * dim, generator=gen), torch.randn(rows, kv_heads * dim, generator=gen)
    empty = torch.empty(rows, 0)
    out = lib.attn_decode(q, k, v, num_heads=heads, num_kv_heads=kv_heads, q_norm=None, k_norm=None, eps=1e-6,
                          rot_dim=0, interleaved=False, cos=empty, sin=empty, k_cache=k_cache, v_cache=v_cache,
                          block_tables=tables, starts=positions, positions=positions, lengths=[1] * rows,
                          num_keys=max(positions) + 1, window=None, scale=dim ** -0.5, sinks=None, chunk=chunk)
    for row, pos in enumerate(positions):
        flat = lambda c: c[tables[row].long()].reshape(-1, kv_heads, dim)[: pos + 1].transpose(0, 1)  # noqa: E731
        read = lambda seq, j0, j1: (flat(k_cache)[:, j0:j1], flat(v_cache)[:, j0:j1])  # noqa: E731
        want = paged.attend_paged(q[row].view(1, heads, 1, dim), read, [pos], [1], dim ** -0.5, value_dim=dim,
                                  chunk=chunk)
        torch.testing.assert_close(out[row], want[0, 0], rtol=1e-5, atol=1e-5)


def test_a_prefix_resumed_from_cached_blocks_inside_a_later_chunk_computes_a_fresh_prefill(llama4):
    """The second half of a prompt prefilled on top of cached blocks (starting mid-chunk, as a reused prefix does)
    gives the logits of the whole prompt prefilled at once."""
    path, _ = llama4
    model = open_runtime(path).model
    pool = model.new_pool(num_blocks=16, block_size=4)
    prompt = random_prompt(3, 29)
    model.forward(ForwardBatch.from_token_lists([prompt[:13]], [0], [0], [[0, 1, 2, 3]]), pool)
    resumed = model.forward(ForwardBatch.from_token_lists([prompt[13:]], [13], [1], [[0, 1, 2, 3, 4, 5, 6, 7]]),
                            pool, last_only=False)
    fresh = model.forward(ForwardBatch.from_token_lists([prompt], [0], [2], [[8, 9, 10, 11, 12, 13, 14, 15]]), pool,
                          last_only=False)[:, 13:]
    torch.testing.assert_close(resumed, fresh, rtol=0, atol=1e-4 * float(fresh.max() - fresh.min()))


def test_the_emulated_device_runs_transformers_tokens(llama4):
    path, reference = llama4
    assert_emulated_device_matches(path, reference)


def test_the_decode_chain_says_why_llama4_keeps_the_python_path(llama4):
    path, _ = llama4
    chain = open_runtime(path).model.decode_chain()
    assert "Llama-4" in chain.reason


def test_the_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """Llama-4 Scout / Maverick ship as Llama4ForConditionalGeneration: a vision tower beside the language model
    (``text_config``, ``language_model.model.*``). moed reads the language model alone; its logits are
    transformers'."""
    import transformers as tf

    text = tiny_config("llama4_text").to_dict()
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=16, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                  pixel_shuffle_ratio=0.5)
    config = tf.Llama4Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    assert_multimodal_language_model(tf.Llama4ForConditionalGeneration(config).eval(), tmp_path, "llama4")


@pytest.mark.parametrize("change,error,words", [
    ({"num_experts_per_tok": 2}, UnsupportedModelError, "one expert per token"),
    ({"no_rope_layers": [1, 0]}, ModelFormatError, "no_rope_layers"),
    ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None}, ModelFormatError,
     "attention_chunk_size"),
    ({"interleave_moe_layer_step": 2, "moe_layers": None, "intermediate_size_mlp": 0}, ModelFormatError,
     "intermediate_size_mlp"),
])
def test_configs_moed_cannot_run_are_refused_with_the_field(change, error, words):
    cfg = dict(tiny_config("llama4_text").to_dict(), **change)
    with pytest.raises(error, match=words):
        parse_model_config(cfg)


