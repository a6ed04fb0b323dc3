"""MLA decode on the latent cache itself (absorbed kv_b) against the expanded form, on a tiny DeepSeek-V3."""

from __future__ import annotations

import pytest
import torch

from moed.layers import mla_attention
from moed.runner.forward_batch import ForwardBatch

pytest.importorskip("transformers")


def _decode_logits(runtime, prompt: list[int], steps: int) -> list[torch.Tensor]:
    cache = runtime.model.new_pool(32, 16)
    table = list(range(31, -1, -1))
    batch = ForwardBatch.from_token_lists([prompt], [0], [0], [table])
    logits = [runtime.model.forward(batch, cache)[0]]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        batch = ForwardBatch.from_token_lists([[tokens[-1]]], [len(tokens) - 1], [0], [table])
        logits.append(runtime.model.forward(batch, cache)[0])
    return logits


def test_absorbed_decode_gives_the_expanded_forms_logits(tmp_path, monkeypatch):
    from helpers.tiny_models import build_tiny_model
    from moed.engine.runtime import open_runtime

    build_tiny_model("deepseek_v3", tmp_path)
    runtime = open_runtime(tmp_path)
    try:
        prompt = torch.randint(3, 500, (120,), generator=torch.Generator().manual_seed(3)).tolist()
        absorbed = _decode_logits(runtime, prompt, 12)
        monkeypatch.setattr(mla_attention, "ABSORB_MAX_STEPS", 0)  # every step expands the latent
        expanded = _decode_logits(runtime, prompt, 12)
    finally:
        runtime.close()
    for a, e in zip(absorbed, expanded):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-4 * float(e.abs().max()))
