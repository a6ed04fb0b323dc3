"""Results never depend on where experts ran: the same greedy tokens for every cache size and policy.

Device experts are computed by the device's torch code (on the emulated device: the same torch
code CUDA runs, on CPU tensors), the CPU branch by the native / numba kernels, so a step's logits
agree within float32 rounding (stated: LOGIT_TOL of the logits' range), not bit for bit; the
merge sums the top-k slots in a fixed order wherever they ran. Greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import build_tiny_model
from moed.config import EngineConfig
from moed.engine.runtime import open_runtime
from moed.kernels.expert_matmul import DIRECT_MAX_TOKENS
from moed.runner.forward_batch import ForwardBatch

POLICIES = ("adaptive", "fill-all", "cpu-all", "static", "hot-set", "fixed-share", "lru-freq")
FRACTIONS = (0.0, 0.1, 0.5, 1.0)
STEPS = 32
LOGIT_TOL = 1e-4  # max |difference| / max |logit|, per step


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "deepseek_v3"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_model(request.param, path)
    return path


def greedy_logits(runtime, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill a batch, then 32 greedy steps; every step's logits [B, V]."""
    model = runtime.model
    cache = model.new_cache(len(prompts), 128)
    slots = list(range(len(prompts)))
    feed, starts, out = prompts, [0] * len(prompts), []
    for _ in range(STEPS):
        logits = model.forward(ForwardBatch.from_token_lists(feed, starts, slots), cache)
        out.append(logits)
        starts = [s + len(f) for s, f in zip(starts, feed)]
        feed = [[int(t)] for t in logits.argmax(-1)]
    return out


def test_greedy_tokens_are_identical_for_every_cache_size_and_policy(model_dir):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (9, 4)]
    assert sum(map(len, prompts)) <= DIRECT_MAX_TOKENS, "an expert call could leave the numba kernel"
    baseline_rt = open_runtime(model_dir, engine=EngineConfig(device="cpu"))
    baseline = greedy_logits(baseline_rt, prompts)
    checked = 0
    for policy in POLICIES:
        for fraction in FRACTIONS:
            engine = EngineConfig(device="emulated", cache_fraction=fraction, policy=policy,
                                  policy_options=(("cpu_share", 0.5),) if policy == "fixed-share" else (),
                                  emulated_b_p=50e9)
            runtime = open_runtime(model_dir, engine=engine)
            try:
                got = greedy_logits(runtime, prompts)
                stats = runtime.executor.stats
            finally:
                runtime.close()
            for step, (a, b) in enumerate(zip(baseline, got)):
                assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{policy} at cache {fraction:.0%}: step {step} tokens differ"
                err = float((a - b).abs().max() / a.abs().max())
                assert err <= LOGIT_TOL, f"{policy} at cache {fraction:.0%}: step {step} logits differ by {err:.2e}"
            if fraction > 0 and policy not in ("cpu-all",):
                assert stats.hits + stats.fills + stats.transient_fills > 0, f"{policy} at {fraction:.0%} never used the device"
            if fraction == 0:
                assert stats.hits == 0 and stats.fills == 0 and stats.transient_fills == 0
            checked += 1
    assert checked == len(POLICIES) * len(FRACTIONS)
