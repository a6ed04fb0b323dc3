"""Kimi-Linear beyond the family parity suite: its layer pattern and config names, the emulated device, and the
configs moed refuses."""

from __future__ import annotations

import pytest

from helpers.reference_parity import assert_emulated_device_matches
from helpers.tiny_models import build_tiny_model, tiny_config
from moed.engine.runtime import open_runtime
from moed.errors import ModelFormatError, UnsupportedModelError
from moed.models.families import parse_model_config


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_linear")
    return path, build_tiny_model("kimi_linear", path)


def test_the_config_maps_its_own_names_and_layer_pattern(kimi):
    path, _ = kimi
    config = open_runtime(path).model.config
    assert config.linear_layers == (True, True, False, True) and config.moe_layers == (False, True, True, True)
    assert config.nope_layers == (True,) * 4 and config.attention.kind == "mla"
    assert config.attention.latent_norm_eps == 1e-6 and config.rms_norm_eps == 1e-5
    assert config.moe.top_k == 2 and config.moe.routed_scaling_factor == 2.446 and config.moe.shared_intermediate_size
    assert config.max_position_embeddings == 256
    kda = config.linear_attention
    assert (kda.num_heads, kda.head_dim, kda.conv_kernel) == (2, 32, 4)


def test_the_emulated_device_runs_transformers_tokens(kimi):
    path, reference = kimi
    assert_emulated_device_matches(path, reference)


@pytest.mark.parametrize("change,error,words", [
    ({"mla_use_nope": False}, UnsupportedModelError, "mla_use_nope"),
    ({"mla_use_output_gate": True}, UnsupportedModelError, "Kimi-K3"),
    ({"linear_attn_config": {"num_heads": 2, "head_dim": 32, "kda_layers": [1, 2], "full_attn_layers": [3]}},
     ModelFormatError, "each of the 4 layers"),
])
def test_configs_moed_cannot_run_are_refused_with_the_field(change, error, words):
    cfg = dict(tiny_config("kimi_linear").to_dict(), **change)
    with pytest.raises(error, match=words):
        parse_model_config(cfg)


def test_kimi_k2_is_deepseek_v3s_model_with_moonshots_tool_calls():
    """Kimi-K2's config.json says model_type kimi_k2 and DeepseekV3ForCausalLM: DeepSeek-V3's model, read by Kimi's
    tool-call parser (its answers are not written in DeepSeek's tokens)."""
    from moed.models.families import FAMILIES, family_of

    cfg = dict(tiny_config("deepseek_v3").to_dict(), model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    assert family_of(cfg).name == "kimi_k2" and FAMILIES["kimi_k2"].tool_format == "kimi"
    assert parse_model_config(cfg).attention == parse_model_config(tiny_config("deepseek_v3").to_dict()).attention
