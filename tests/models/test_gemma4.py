"""Gemma-4's parts beyond the family parity suite: its config read as the released checkpoints and transformers
write it, the proportional rotary, the multimodal checkpoint's language model, the emulated device, the decode
chain's refusal, and the configs moed refuses."""

from __future__ import annotations

import pytest
import torch

from helpers.reference_parity import assert_emulated_device_matches, assert_multimodal_language_model
from helpers.tiny_models import build_tiny_model, tiny_config
from moed.engine.runtime import open_runtime
from moed.errors import ModelFormatError, UnsupportedModelError
from moed.layers.rotary import rope_inv_freq
from moed.models.families import parse_model_config


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4")
    return path, build_tiny_model("gemma4_text", path)



def test_the_config_gives_each_layer_kind_its_own_attention_and_rotary(gemma):
    path, _ = gemma
    config = open_runtime(path).model.config
    assert config.sliding_windows == (6, None, None) and config.layer_recipe == "gemma4"
    sliding, full = config.layer_attention(0), config.layer_attention(1)
    assert (sliding.head_dim, sliding.num_kv_heads, sliding.k_eq_v) == (32, 2, False)
    assert (full.head_dim, full.num_kv_heads, full.k_eq_v) == (64, 1, True)
    assert sliding.scaling == full.scaling == 1.0 and sliding.v_norm and full.qk_norm == "per_head"
    assert config.layer_rope(1).rope_type == "proportional" and config.layer_rope(1).dim == 64
    assert config.scale_embedding and config.final_logit_softcapping == 30.0
    assert config.moe.activation == "gelu_tanh" and config.mlp_activation == "gelu_tanh"


def test_the_proportional_rotary_is_transformers_own():
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny_config("gemma4_text")
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu", layer_type="full_attention")
    ours = parse_model_config(cfg.to_dict()).layer_rope(1)
    got, factor = rope_inv_freq(ours, 256)
    assert factor == 1.0 and torch.equal(got, want) and int((got == 0).sum()) == 32 - 8
    assert isinstance(cfg, Gemma4TextConfig)


def test_a_config_as_released_reads_like_the_one_transformers_saves(gemma):
    """The released config.json names the full layers' shape global_head_dim / num_global_key_value_heads;
    transformers saves per_layer_config instead: both give the same model."""
    path, _ = gemma
    saved = tiny_config("gemma4_text").to_dict()
    released = {k: v for k, v in saved.items() if k != "per_layer_config"}
    released.update(global_head_dim=64, num_global_key_value_heads=1)
    assert parse_model_config(released) == parse_model_config(saved)
    del released["tie_word_embeddings"]  # Gemma-4 ties its embeddings unless the config says otherwise
    assert parse_model_config(released).tie_word_embeddings


def test_the_multimodal_checkpoint_loads_its_language_model(tmp_path):
    import transformers as tf

    text = tiny_config("gemma4_text").to_dict()
    config = tf.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    torch.manual_seed(0)
    assert_multimodal_language_model(tf.Gemma4ForConditionalGeneration(config).eval(), tmp_path, "gemma4")


def test_the_emulated_device_runs_transformers_tokens(gemma):
    path, reference = gemma
    assert_emulated_device_matches(path, reference)


def test_the_decode_chain_says_why_gemma4_keeps_the_python_path(gemma):
    path, _ = gemma
    assert "Gemma-4" in open_runtime(path).model.decode_chain().reason


@pytest.mark.parametrize("change,error,words", [
    ({"hidden_size_per_layer_input": 256}, UnsupportedModelError, "per-layer embeddings"),
    ({"num_kv_shared_layers": 2}, UnsupportedModelError, "KV sharing"),
    ({"hidden_activation": "silu"}, UnsupportedModelError, "hidden_activation"),
    ({"use_bidirectional_attention": "all"}, UnsupportedModelError, "causal"),
    ({"layer_types": ["sliding_attention"]}, ModelFormatError, "layer_types"),
])
def test_configs_moed_cannot_run_are_refused_with_the_field(change, error, words):
    cfg = dict(tiny_config("gemma4_text").to_dict(), **change)
    with pytest.raises(error, match=words):
        parse_model_config(cfg)
