"""Parity with transformers (the reference) for every supported family, HF and FTW directories."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import FAMILIES, build_tiny_model
from moed.engine.offline_run import run_offline
from moed.engine.runtime import open_runtime
from moed.engine.sampling import SamplingParams
from moed.runner.forward_batch import ForwardBatch
from moed.weights.converter import convert_model

TOL = 1e-4
PROMPT_LENGTHS = (13, 5, 9)


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    family = request.param
    path = tmp_path_factory.mktemp(family)
    reference = build_tiny_model(family, path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    return family, path, reference, prompts


def reference_logits(reference, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits[0]  # [T, V]


def reference_greedy(reference, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def batched_prefill_logits(runtime, prompts: list[list[int]]) -> torch.Tensor:
    cache = runtime.model.new_cache(len(prompts), 128)
    batch = ForwardBatch.from_token_lists(prompts, [0] * len(prompts), list(range(len(prompts))))
    return runtime.model.forward(batch, cache, last_only=False)  # [B, T, V]


def greedy(runtime, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens from the engine loop, every prompt in one batch from the first step."""
    params = [SamplingParams(max_tokens=steps, ignore_eos=True)] * len(prompts)
    return [r.token_ids for r in run_offline(runtime, prompts, params, context_length=128)]


def ftw_weights_equal(a, b) -> int:
    """Assert two loads hold byte-identical weights (same names, dtypes, shapes); returns tensors compared."""
    assert a.config == b.config
    assert sorted(a.weights) == sorted(b.weights)
    pairs = [(f"weights[{k}]", a.weights[k], b.weights[k]) for k in a.weights]
    assert a.bank.dtype == b.bank.dtype and sorted(a.bank.tensors) == sorted(b.bank.tensors)
    pairs += [(f"bank[{k}]", a.bank.tensors[k], b.bank.tensors[k]) for k in a.bank.tensors]
    for name, x, y in pairs:
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), f"{name} differs between the FTW and HF loads"
    return len(pairs)


def test_prefill_logits_match_reference_in_a_batch_of_different_lengths(family_model):
    family, path, reference, prompts = family_model
    runtime = open_runtime(path)
    ours = batched_prefill_logits(runtime, prompts)
    for row, prompt in enumerate(prompts):
        err = (ours[row, : len(prompt)] - reference_logits(reference, prompt)).abs().max().item()
        assert err < TOL, f"{family}: prompt {row} max abs logit error {err}"


def test_32_greedy_tokens_match_reference_alone_and_batched(family_model):
    family, path, reference, prompts = family_model
    runtime = open_runtime(path)
    expected = [reference_greedy(reference, p, 32) for p in prompts]
    assert any(len(set(e)) > 1 for e in expected), "test model decodes one repeated token: too weak"
    assert greedy(runtime, prompts[:1], 32) == expected[:1], family
    assert greedy(runtime, prompts, 32) == expected, f"{family}: batched greedy differs"


def test_ftw_fp32_conversion_keeps_parity(family_model, tmp_path):
    family, path, reference, prompts = family_model
    dst = convert_model(path, tmp_path / "ftw", experts_dtype="fp32")
    runtime = open_runtime(dst, verify=True)
    assert runtime.loaded.format == "ftw"
    hf = open_runtime(path)
    # The weights must be the same bytes: that is what the converter promises and we control it.
    # The logits only within TOL: the two loads place tensors at different addresses, and BLAS may
    # pick a different kernel (so a different summation order) for a different alignment.
    assert ftw_weights_equal(runtime.loaded, hf.loaded) > 0
    ours = batched_prefill_logits(runtime, prompts)
    hf_ours = batched_prefill_logits(hf, prompts)
    assert (ours - hf_ours).abs().max().item() < TOL, f"{family}: FTW and HF loads of the same weights disagree"
    for row, prompt in enumerate(prompts):
        err = (ours[row, : len(prompt)] - reference_logits(reference, prompt)).abs().max().item()
        assert err < TOL, f"{family} (FTW): prompt {row} max abs logit error {err}"
    assert greedy(runtime, prompts, 32) == [reference_greedy(reference, p, 32) for p in prompts]


def test_the_multimodal_qwen3_5_checkpoint_loads_its_language_model(tmp_path):
    """Qwen3.6-35B-A3B ships as Qwen3_5MoeForConditionalGeneration: a vision tower beside the language model
    (``text_config``, ``model.language_model.*``). moed loads the language model alone, and its logits for
    text are transformers' (HF directory and FTW conversion alike)."""
    import transformers as tf

    from helpers.tiny_models import COMMON, tiny_config

    text = tiny_config("qwen3_5_moe_text").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=COMMON["hidden_size"],
                  patch_size=4, spatial_merge_size=1, temporal_patch_size=1)
    config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = tf.Qwen3_5MoeForConditionalGeneration(config).eval()
    with torch.no_grad():  # scaled up from the small init, as helpers.tiny_models does
        for name, param in reference.named_parameters():
            if param.dim() >= 2:
                param.mul_(4.0)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
    reference.save_pretrained(tmp_path / "hf")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.visual.") for k in keys) and any(k.startswith("model.language_model.") for k in keys)
    prompt = torch.randint(3, 500, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    want = reference_logits(reference, prompt)
    convert_model(tmp_path / "hf", tmp_path / "ftw")
    for path in (tmp_path / "hf", tmp_path / "ftw"):
        runtime = open_runtime(path)
        assert runtime.model.config.family == "qwen3_5_moe" and runtime.model.has_recurrent_state
        got = batched_prefill_logits(runtime, [prompt])[0]
        assert (got - want).abs().max().item() < TOL, path.name


@pytest.mark.parametrize("family,change,words", [
    ("qwen3_next", {"layer_types": ["linear_attention", "sliding_attention", "full_attention"]},
     "layer_types must give linear_attention or full_attention"),
    ("qwen3_next", {"layer_types": ["linear_attention"]}, "each of the 3 layers"),
    ("qwen3_next", {"linear_num_key_heads": 3}, "not a multiple"),
])
def test_bad_hybrid_configs_are_refused_naming_the_field(family, change, words):
    from helpers.tiny_models import tiny_config
    from moed.errors import ModelFormatError
    from moed.models.families import parse_model_config

    cfg = dict(tiny_config(family).to_dict(), **change)
    with pytest.raises(ModelFormatError, match=words):
        parse_model_config(cfg)


def test_a_multimodal_qwen3_5_config_without_its_text_config_is_refused():
    from moed.errors import ModelFormatError
    from moed.models.families import parse_model_config

    with pytest.raises(ModelFormatError, match="text_config"):
        parse_model_config({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"]})
