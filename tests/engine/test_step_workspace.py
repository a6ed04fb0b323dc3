"""The step workspace estimate (engine/step_workspace.py) against the peak a real step reaches.

Each case builds a model wide enough that a step's activations are tens of MB, opens it on the CPU
executor or the emulated device (the torch code CUDA runs, on CPU tensors), runs a small step (one-time
conversions out of the way), then one prefill step of T tokens in a fresh interpreter, and reads how
far the process's peak RSS rose: the estimate must cover it, and not by more than a few times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.tiny_models import build_tiny_model, tiny_config
from moed.engine.step_workspace import step_workspace_bytes
from moed.weights.model_loader import read_model_config

pytest.importorskip("transformers")

MIB = 1 << 20

_STEP = r"""
import json, sys, torch
from moed.config import EngineConfig
from moed.engine.runtime import open_runtime
from moed.engine.step_workspace import step_workspace_bytes
from moed.runner.forward_batch import ForwardBatch

path, device, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
rt = open_runtime(path, engine=EngineConfig(device=device, cache_fraction=1.0, emulated_b_p=50e9))
model = rt.model
cache = model.new_pool(-(-tokens // 16) + 4, 16, state_slots=2)
table = list(range(cache.num_blocks))
ids = torch.randint(3, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
model.forward(ForwardBatch.from_token_lists([ids[:40]], [0], [0], [table], [0]), cache)  # one-time work
def status():
    return dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = int(status()["VmRSS"].split()[0]) << 10
model.forward(ForwardBatch.from_token_lists([ids], [0], [1], [table], [1]), cache)
peak = int(status()["VmHWM"].split()[0]) << 10
print(json.dumps({"rise": peak - before}))
"""


def _wide(family: str):
    config = tiny_config(family)
    if family == "deepseek_v3":
        for key, value in dict(hidden_size=512, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=128,
                               qk_nope_head_dim=64, qk_rope_head_dim=32, head_dim=32, v_head_dim=64,
                               intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=16,
                               num_experts_per_tok=4).items():
            setattr(config, key, value)
        config.qk_head_dim = 96
    else:
        for key, value in dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                               moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4).items():
            setattr(config, key, value)
        if family == "qwen3_next":
            config.linear_num_key_heads, config.linear_num_value_heads = 4, 8
            config.linear_key_head_dim = config.linear_value_head_dim = 64
            config.shared_expert_intermediate_size = 256
    return config


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="the peak RSS can be reset on Linux only")
@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_the_estimate_covers_a_real_steps_peak(family, device, tmp_path):
    build_tiny_model(family, tmp_path, config=_wide(family), scale=1.0)
    tokens = 4096
    out = subprocess.run([sys.executable, "-c", _STEP, str(tmp_path), device, str(tokens)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rise = json.loads(out.stdout.strip().splitlines()[-1])["rise"]
    estimate = step_workspace_bytes(read_model_config(tmp_path), tokens)  # the emulated device's tensors are CPU ones
    assert rise > 8 * MIB, f"the step rose by only {rise / MIB:.1f} MiB: too small to say anything"
    assert rise <= estimate, f"measured {rise / MIB:.1f} MiB > estimated {estimate / MIB:.1f} MiB"
    assert estimate <= 4 * rise + 64 * MIB, f"estimated {estimate / MIB:.1f} MiB for {rise / MIB:.1f} MiB measured"


def test_a_device_prefill_step_of_deepseek_v3_is_gigabytes():
    """The reason the device share books it: 8192 tokens through DeepSeek-V3's experts."""
    from moed.models.families import parse_model_config

    raw = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
           "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
           "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
           "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 163840, "rope_theta": 10000}
    config = parse_model_config(raw)
    assert step_workspace_bytes(config, 8192, device_type="cuda") > 4 << 30
    assert step_workspace_bytes(config, 1024) < step_workspace_bytes(config, 8192, device_type="cuda") / 6
