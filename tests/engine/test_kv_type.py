"""--kv-type: the KV pool's type chosen at load (bf16, f32, q8_0), in the load plan and in the engine.

q8_0 (llama.cpp's -ctk/-ctv q8_0) keeps 8.5 bits per value: the plan books 17/32 of bf16's bytes and
gives a longer automatic context for the same RAM; the model's logits with a q8_0 pool stay as close
to a float32 pool's as a bf16 pool's do (within 2x), greedy tokens agree.
"""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import build_tiny_model, build_tiny_model_dir, tiny_config
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.load_plan import plan_load
from moed.engine.model_manager import LoadOptions, ModelManager
from moed.engine.request import GenerationRequest
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError
from moed.runner.forward_batch import ForwardBatch

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = build_tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3_moe")  # head dim 32
    build_tiny_model_dir(root, "deepseek_v3", "mla8")  # a rotary key of 8 values: no q8_0
    config = tiny_config("qwen3_moe")
    config.max_position_embeddings = 1 << 16  # room for an automatic context beyond the 4096 floor
    build_tiny_model("qwen3_moe", root / "long", config=config)
    write_tiny_tokenizer(root / "long")
    return root


def test_the_plan_books_q8_0s_bytes_and_stretches_the_automatic_context(models):
    bf16 = plan_load(models / "tiny", LoadOptions(context_length=256, kv_type="bf16"))
    q8 = plan_load(models / "tiny", LoadOptions(context_length=256, kv_type="q8_0"))
    f32 = plan_load(models / "tiny", LoadOptions(context_length=256, kv_type="f32"))
    assert q8.kv_dtype == torch.int8 and bf16.kv_dtype == torch.bfloat16 and f32.kv_dtype == torch.float32
    assert q8.kv_bytes_per_token * 32 == bf16.kv_bytes_per_token * 17 and f32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token
    # the same RAM holds about twice the automatic context
    room = bf16.weight_bytes + bf16.workspace_bytes + 2 * 8192 * bf16.kv_bytes_per_token
    auto = {t: plan_load(models / "long", LoadOptions(max_batch=1, kv_type=t), available_bytes=room).context_length
            for t in ("bf16", "q8_0")}
    assert auto["bf16"] >= 4096 and auto["q8_0"] > 1.8 * auto["bf16"], auto


@pytest.mark.parametrize("kv_type,words", [("q4_0", "choose one of f32, bf16, q8_0"), ("fp16", "kv_type")])
def test_unknown_types_are_refused(models, kv_type, words):
    with pytest.raises(InvalidRequestError, match=words):
        plan_load(models / "tiny", LoadOptions(context_length=256, kv_type=kv_type))


def test_a_model_whose_rows_do_not_split_into_32s_is_refused_with_a_way_out(models):
    with pytest.raises(InvalidRequestError, match="k_rot.*8.*--kv-type bf16"):
        plan_load(models / "mla8", LoadOptions(context_length=256, kv_type="q8_0"))


def test_a_q8_0_load_runs_its_engine_on_an_int8_pool(models):
    manager = ModelManager([models])
    entry = manager.load("tiny", LoadOptions(context_length=256, kv_type="q8_0", device="cpu"))
    try:
        cache = entry.loop._cache
        assert cache.quantized and cache.entry(1, "k").dtype == torch.int8
        handle = entry.loop.submit(GenerationRequest("q8", list(range(3, 40)),
                                                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
        events = list(handle.events(timeout=60))
        assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 8
    finally:
        manager.unload("tiny")


def _teacher_forced(model, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Logits at every position: a 40-token prefill, then one token per step (the native decode kernel)."""
    model.kv_dtype = dtype
    cache = model.new_pool(16, 16)
    table = list(range(16))
    out = [model.forward(ForwardBatch.from_token_lists([tokens[:40]], [0], [0], [table]), cache, last_only=False)[0]]
    for i in range(40, len(tokens)):
        out.append(model.forward(ForwardBatch.from_token_lists([[tokens[i]]], [i], [0], [table]), cache))
    return torch.cat(out).float()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_q8_0_logits_stay_close_to_a_float32_pools(family, tmp_path):
    config = tiny_config(family)
    if family == "deepseek_v3":
        config.qk_rope_head_dim = config.head_dim = 32  # latent 32 and rotary key 32: q8_0 rows
    build_tiny_model(family, tmp_path, config=config)
    runtime = open_runtime(tmp_path)
    try:
        tokens = torch.randint(3, 500, (120,), generator=torch.Generator().manual_seed(4)).tolist()
        ref = _teacher_forced(runtime.model, tokens, torch.float32)
        err = {dtype: (_teacher_forced(runtime.model, tokens, dtype) - ref).abs().max().item()
               for dtype in (torch.bfloat16, torch.int8)}
        agree = (_teacher_forced(runtime.model, tokens, torch.int8).argmax(-1) == ref.argmax(-1)).float().mean()
    finally:
        runtime.close()
    # the tiny random models amplify K/V rounding (bf16 alone moves logits by ~6% of their spread): q8_0 must
    # not be much worse than bf16, and the greedy choices must hold
    assert 0 < err[torch.int8] < 2 * err[torch.bfloat16], err
    assert agree >= 0.95, agree
