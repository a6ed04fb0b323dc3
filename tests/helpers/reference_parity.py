"""One check shared by the checkpoint-format tests: a moed runtime against a transformers reference."""

from __future__ import annotations

import torch

from moed.engine.offline_run import run_offline
from moed.engine.sampling import SamplingParams
from moed.runner.forward_batch import ForwardBatch


def assert_matches_reference(runtime, reference, *, tol: float, tokens_equal: bool = True, steps: int = 12,
                             seed: int = 2, what: str = "", vocab: int = 500) -> float:
    """Logits of a random 9-token prompt (ids below ``vocab``) within ``tol`` (times the logits' range when that is
    above 1) of ``reference``'s, and (``tokens_equal``) the same ``steps`` greedy tokens through the engine
    loop; returns the largest logit difference."""
    p = torch.randint(3, vocab, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    logits = runtime.model.forward(ForwardBatch.from_token_lists([p], [0], [0]), runtime.model.new_cache(1, 64),
                                   last_only=False)[0]
    with torch.no_grad():
        ref = reference(torch.tensor([p])).logits[0]
        expected = reference.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(p):].tolist()
    err = (logits - ref).abs().max().item()
    assert err < tol * max(1.0, ref.abs().max().item()), (what, err)
    if tokens_equal:
        (done,) = run_offline(runtime, [p], [SamplingParams(max_tokens=steps, ignore_eos=True)], context_length=64)
        assert done.token_ids == expected, what
    return err


def expected_greedy(model_dir, prompt: str, steps: int = 32) -> tuple[list[int], str]:
    """transformers' greedy tokens (past any end token) for ``prompt`` as moed tokenizes it, and their text."""
    import transformers as tf

    from moed.text.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    ids = tok.encode(prompt)
    reference = tf.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    tokens = out[0, len(ids):].tolist()
    return tokens, tok.decode(tokens)


def random_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny vocabulary (past the special ones), the same for a seed."""
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_greedy(reference, prompt: list[int], steps: int) -> list[int]:
    """transformers' ``steps`` greedy tokens after ``prompt`` (no end token)."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_emulated_device_matches(path, reference, *, prompt_len: int = 11, steps: int = 24) -> None:
    """The model at ``path`` on the emulated device generates transformers' greedy tokens."""
    from moed.config import EngineConfig
    from moed.engine.runtime import open_runtime

    runtime = open_runtime(path, engine=EngineConfig(device="emulated"))
    try:
        prompt = random_prompt(6, prompt_len)
        got = run_offline(runtime, [prompt], [SamplingParams(max_tokens=steps, ignore_eos=True)], context_length=64)
        assert got[0].token_ids == reference_greedy(reference, prompt, steps)
    finally:
        runtime.close()


def assert_multimodal_language_model(reference, path, family: str, *, tol: float = 1e-4) -> None:
    """A multimodal transformers ``reference`` (weights scaled up from its small init, as helpers/tiny_models does),
    saved to ``path``, loads in moed as ``family``'s language model alone, with the reference's logits for text."""
    from moed.engine.runtime import open_runtime

    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.dim() >= 2:
                param.mul_(4.0)
            elif "norm" in name or "scale" in name:
                param.uniform_(0.8, 1.2)
    reference.save_pretrained(path)
    prompt = random_prompt(4, 19)
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([prompt])).logits[0]
    runtime = open_runtime(path)
    assert runtime.model.config.family == family
    got = runtime.model.forward(ForwardBatch.from_token_lists([prompt], [0], [0]), runtime.model.new_cache(1, 64),
                                last_only=False)[0]
    assert (got - want).abs().max().item() < tol
