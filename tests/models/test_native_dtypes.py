"""bf16 / fp16 checkpoints run with their non-expert weights in their own dtype (issue #10, item 2).

Reference: transformers in float32 on the same (already rounded) bf16/fp16 weights, so the only
difference left is ours: activations rounded to the weights' dtype before each matmul (float32
accumulation), as llama.cpp does. Tolerance: 5% of the logits' standard deviation; greedy tokens equal.
"""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import build_tiny_model
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.runner.forward_batch import ForwardBatch
from moed.weights.converter import convert_model
from moed.weights.ftw_reader import read_ftw_index

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
STEPS = 16


@pytest.fixture(scope="module", params=[("mixtral", "bf16"), ("qwen3_moe", "bf16"), ("deepseek_v3", "bf16"),
                                        ("gpt_oss", "bf16"), ("qwen2_moe", "fp16")], ids=lambda p: "-".join(p))
def model(request, tmp_path_factory):
    family, dtype = request.param
    fp32_dir = tmp_path_factory.mktemp(f"{family}-fp32")
    reference = build_tiny_model(family, fp32_dir)
    reference = reference.to(DTYPES[dtype])
    path = tmp_path_factory.mktemp(f"{family}-{dtype}")
    reference.save_pretrained(path)
    # float32 arithmetic on the rounded weights; loaded afresh so buffers (rotary inv_freq) are exact
    import transformers as tf

    reference = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return family, dtype, path, reference


def prompt() -> list[int]:
    return torch.randint(3, 500, (11,), generator=torch.Generator().manual_seed(5)).tolist()


def test_weights_stay_in_the_checkpoint_dtype_and_match_the_reference(model):
    family, dtype, path, reference = model
    runtime = open_runtime(path)
    try:
        kept = {t.dtype for t in runtime.loaded.weights.values()}
        assert DTYPES[dtype] in kept
        big = [t for t in runtime.loaded.weights.values() if t.dim() == 2]
        assert all(t.dtype == DTYPES[dtype] for t in big), "a matrix was widened to float32"
        p = prompt()
        cache = runtime.model.new_cache(1, 64)
        ours = runtime.model.forward(ForwardBatch.from_token_lists([p], [0], [0]), cache, last_only=False)[0]
        with torch.no_grad():
            ref = reference(torch.tensor([p])).logits[0]
        err = (ours - ref).abs().max().item()
        spread = ref.std().item()
        assert spread > 0.5
        assert err < 0.05 * spread, f"{family} {dtype}: max |dlogit| {err:.4f} vs spread {spread:.3f}"
        with torch.no_grad():
            expected = reference.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        (done,) = run_offline(runtime, [p], [SamplingParams(max_tokens=STEPS, ignore_eos=True)], context_length=64)
        assert done.token_ids == expected, f"{family} {dtype}: greedy tokens differ"
    finally:
        runtime.close()


def test_fp32_widens_and_matches_float32_reference_tightly(model):
    family, dtype, path, reference = model
    runtime = open_runtime(path, weights_dtype="fp32")
    try:
        assert {t.dtype for t in runtime.loaded.weights.values()} == {torch.float32}
        p = prompt()
        cache = runtime.model.new_cache(1, 64)
        ours = runtime.model.forward(ForwardBatch.from_token_lists([p], [0], [0]), cache, last_only=False)[0]
        with torch.no_grad():
            ref = reference(torch.tensor([p])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-3
    finally:
        runtime.close()


def test_ftw_keeps_the_checkpoint_dtype_and_is_smaller(model, tmp_path):
    family, dtype, path, _ = model
    dst = convert_model(path, tmp_path / "ftw", experts_dtype="bf16")
    index = read_ftw_index(dst)
    weights = [t for t in index.tensors.values() if t.kind == "weight" and len(t.shape) == 2]
    assert weights and all(t.dtype == {"bf16": "bfloat16", "fp16": "float16"}[dtype] for t in weights)
    hf, ftw = open_runtime(path), open_runtime(dst)
    try:
        for name, t in hf.loaded.weights.items():
            assert torch.equal(ftw.loaded.weights[name], t), name
    finally:
        hf.close()
        ftw.close()
