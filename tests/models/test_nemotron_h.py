"""Nemotron-H's parts beyond the family parity suite: its blocks paired into moed's layers, the emulated device, a
long prefill through the chunked Mamba-2 form, and the configs moed refuses."""

from __future__ import annotations

import pytest
import torch

from helpers.reference_parity import assert_emulated_device_matches, random_prompt
from helpers.tiny_models import build_tiny_model, tiny_config
from moed.engine.runtime import open_runtime
from moed.errors import ModelFormatError, UnsupportedModelError
from moed.models.families import parse_model_config
from moed.runner.forward_batch import ForwardBatch


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h")
    return path, build_tiny_model("nemotron_h", path)




def test_blocks_pair_into_layers_with_and_without_a_feed_forward_part(nemotron):
    path, _ = nemotron
    config = open_runtime(path).model.config
    # blocks M E M * E M -: layers (M+E) (M) (*+E) (M+-)
    assert config.num_layers == 4 and config.linear_layers == (True, True, False, True)
    assert config.mlp_layers == (True, False, True, True) and config.moe_layers == (True, False, True, False)
    assert config.nope_layers == (True,) * 4 and config.mlp_activation == "relu2"
    assert config.moe.activation == "relu2" and config.moe.scoring == "sigmoid" and config.moe.top_k == 2
    la = config.linear_attention
    assert (la.num_heads, la.head_dim, la.num_groups, la.state_size, la.conv_kernel) == (4, 16, 2, 16, 4)
    assert la.dt_max == float("inf")  # transformers writes time_step_limit's infinity as {"__float__": "Infinity"}


def test_a_prefill_longer_than_several_chunks_matches_transformers(nemotron):
    """A 200-token prompt: the chunked Mamba-2 form (128-token chunks) and attention over all of it."""
    path, reference = nemotron
    runtime = open_runtime(path)
    prompt = random_prompt(11, 200)
    got = runtime.model.forward(ForwardBatch.from_token_lists([prompt], [0], [0]), runtime.model.new_cache(1, 256),
                                last_only=False)[0]
    with torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0]
    assert (got - want).abs().max().item() < 1e-3 * float(want.abs().max())


def test_the_emulated_device_runs_transformers_tokens(nemotron):
    path, reference = nemotron
    assert_emulated_device_matches(path, reference)


@pytest.mark.parametrize("change,error,words", [
    ({"hybrid_override_pattern": "EM*"}, UnsupportedModelError, "follows no Mamba or attention block"),
    ({"hybrid_override_pattern": "MEEM"}, UnsupportedModelError, "follows no Mamba or attention block"),
    ({"hybrid_override_pattern": "MXE"}, ModelFormatError, "hybrid_override_pattern"),
    ({"moe_latent_size": 32}, UnsupportedModelError, "latent"),
    ({"mlp_hidden_act": "silu"}, UnsupportedModelError, "mlp_hidden_act"),
    ({"mamba_num_heads": 3}, ModelFormatError, "groups"),
    ({"time_step_limit": [0.0]}, ModelFormatError, "time_step_limit"),
])
def test_configs_moed_cannot_run_are_refused_with_the_field(change, error, words):
    cfg = {k: v for k, v in tiny_config("nemotron_h").to_dict().items() if k != "layers_block_type"}
    cfg["hybrid_override_pattern"] = "MEM*EM-"
    cfg.update(change)
    with pytest.raises(error, match=words):
        parse_model_config(cfg)
