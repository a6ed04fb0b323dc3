"""DeepSeek-V4's family (issue #33): its config (transformers 5.25's DeepseekV4Config, legacy keys included) parses
into the per-layer compression, hash routing, hyper-connection and rotary fields; the names moed expects are exactly
the tensors transformers saves (DeepSeek's own layout); the whole-sequence reference forward is transformers; a load
builds the model; `moed fit` plans the real V4-Flash config (284 B parameters, 13 B active). (Parity through the
engine, CLI, daemon and HTTP: tests/models/test_family_parity.py, test_sparse_attention.py; prefix reuse:
tests/engine/test_prefix_cache.py.)"""

from __future__ import annotations

import json

import pytest
import torch

tf = pytest.importorskip("transformers")

from moed.engine.fit_plan import GB, fit_machine, format_report, model_needs  # noqa: E402
from moed.errors import ModelFormatError  # noqa: E402
from moed.models.families import parse_model_config  # noqa: E402
from moed.models.weight_spec import expected_weight_shapes  # noqa: E402
from moed.weights.hf_checkpoint import HfCheckpoint  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
            head_dim=32, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"])


@pytest.fixture(scope="module")
def tiny_v4_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4")
    torch.manual_seed(0)
    config = tf.DeepseekV4Config(**TINY)
    config._attn_implementation = "eager"
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # hash tables and correction biases that route (zeros would send every token to expert 0)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(64)]))
            else:
                gate.e_score_correction_bias.copy_(torch.randn(4, generator=gen) * 0.1)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def tiny_v4(tiny_v4_model):
    return tiny_v4_model[0]


def test_the_config_parses_into_v4s_parts(tiny_v4):
    raw = json.loads((tiny_v4 / "config.json").read_text())
    config = parse_model_config(raw)
    assert config.family == "deepseek_v4" and config.attention.kind == "compressed"
    assert config.compress_ratios == (0, 4, 8, 4) and config.csa_ratio == 4
    assert [config.has_indexer(i) for i in range(4)] == [False, True, False, True]
    assert config.hash_layers == (True, True, False, False)
    assert config.hyper.streams == 4 and config.hyper.sinkhorn_iters == 20
    assert config.rope.theta == 10000.0 and config.compress_rope.theta == 160000.0 and config.rope.dim == 4
    assert config.moe.scoring == "sqrtsoftplus" and config.moe.activation == "clamped_silu"
    assert config.moe.swiglu_limit == 10.0 and config.moe.shared_intermediate_size == 32
    assert config.sliding_windows == (8,) * 4
    # the legacy keys some configs still ship
    legacy = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")}
    legacy.update(compress_ratios=[0, 4, 128, 4], compress_rate_hca=8, num_hash_layers=1)
    old = parse_model_config(legacy)
    assert old.compress_ratios == (0, 4, 8, 4) and old.hash_layers == (True, False, False, False)


@pytest.mark.parametrize("edit, match", [
    (dict(o_groups=3), "not divisible by o_groups"),
    (dict(compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 8}), "must divide"),
    (dict(layer_types=["sliding_attention"] * 3 + ["full_attention"]), "layer_types must give"),
])
def test_bad_configs_are_refused_by_name(tiny_v4, edit, match):
    raw = {**json.loads((tiny_v4 / "config.json").read_text()), **edit}
    with pytest.raises(ModelFormatError, match=match):
        parse_model_config(raw)


def test_moeds_names_are_the_tensors_transformers_saves(tiny_v4):
    from safetensors import safe_open

    checkpoint = HfCheckpoint(tiny_v4)
    shapes = expected_weight_shapes(checkpoint.config)
    assert set(checkpoint.weight_keys) == set(shapes)
    with safe_open(str(tiny_v4 / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    for name, key in checkpoint.weight_keys.items():
        assert stored[key] == shapes[name], name
    assert checkpoint.weight_keys["lm_head.weight"] == "head.weight"
    assert checkpoint.weight_keys["model.layers.0.mlp.router.tid2eid"] == "model.layers.0.ffn.gate.tid2eid"
    assert checkpoint.weight_keys["model.layers.2.mlp.router.score_bias"] == "model.layers.2.ffn.gate.bias"
    assert checkpoint.weight_keys["model.layers.2.mlp.shared.up_proj.weight"] == "model.layers.2.ffn.shared_experts.w3.weight"
    assert checkpoint.read_weight("model.layers.0.mlp.router.tid2eid").dtype == torch.int64
    experts = {k for k in stored if ".ffn.experts." in k}
    assert len(experts) == 4 * 4 * 3 and "model.layers.3.ffn.experts.3.w2.weight" in experts
    mapped = set(checkpoint.weight_keys.values())
    assert set(stored) - mapped == experts  # every other tensor has its canonical name


def test_a_load_builds_the_v4_model_on_the_host(tiny_v4):
    from moed.engine.runtime import open_runtime
    from moed.models.deepseek_v4 import DeepseekV4Transformer

    runtime = open_runtime(tiny_v4)
    try:
        model = runtime.model
        assert isinstance(model, DeepseekV4Transformer) and model.has_recurrent_state
        assert model.checkpoint_granularity == 16  # the block size, a multiple of the ratios 4 and 8
        assert runtime.loaded.bank.activation.kind == "clamped_silu" and runtime.loaded.bank.activation.limit == 10.0
        assert [sorted(e) for e in model.cache_entries()] == [["kv"], ["cidx", "ckv", "kv"], ["ckv", "kv"], ["cidx", "ckv", "kv"]]
    finally:
        runtime.close()


def test_fit_plans_the_real_v4_flash_config(tmp_path):
    """transformers' defaults are V4-Flash's sizes; its published layout: FP8 linears, MXFP4 experts."""
    raw = tf.DeepseekV4Config().to_dict()
    raw["architectures"] = ["DeepseekV4ForCausalLM"]
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "expert_dtype": "fp4"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    needs = model_needs(tmp_path / "config.json")
    assert round(needs.total_params / 1e9) == 284 and round(needs.active_params / 1e9) == 13
    assert needs.load.bank_dtype == "mxfp4" and 140 * GB < needs.load.bank_bytes < 155 * GB
    # per token: each layer's K=V row, plus its compressed entries (head_dim / ratio; the indexer's on CSA layers)
    config = parse_model_config(raw)
    per_layer = [512 + (512 // r if r else 0) + (128 // r if config.has_indexer(i) else 0)
                 for i, r in enumerate(config.compress_ratios)]
    assert needs.kv_bytes_per_token == 2 * sum(per_layer)
    fits = [fit_machine(needs, ram * GB, vram * GB) for ram in (24, 64, 128, 256) for vram in (0, 8, 32)]
    assert not any(f.runs for f in fits[:9]) and all("needs" in f.where for f in fits[:9])
    assert all(f.runs for f in fits[9:])
    report = format_report(needs, fits)
    assert "deepseek_v4: 43 layers, 256 experts (top 6), 284." in report and "as mxfp4" in report


def test_the_attention_weights_come_from_the_checkpoint(tiny_v4):
    from moed.layers.compressed_attention import CompressedAttentionWeights

    checkpoint = HfCheckpoint(tiny_v4)
    weights = {name: checkpoint.read_weight(name) for name in checkpoint.weight_keys}
    sliding, csa, hca = (CompressedAttentionWeights.from_weights(weights, f"model.layers.{i}.attn") for i in range(3))
    assert sliding.compressor is None and sliding.indexer is None
    assert csa.compressor.overlap and csa.compressor.ratio == 4 and csa.indexer.compressor.head_dim == 16
    assert not hca.compressor.overlap and hca.compressor.ratio == 8 and hca.indexer is None
    assert tuple(csa.wo_a.shape) == (2 * 16, 4 * 32 // 2) and tuple(hca.sinks.shape) == (4,)


def test_the_reference_forward_is_transformers(tiny_v4_model):
    """The parts composed as the model runs them (models/deepseek_v4_reference.py), on the checkpoint's tensors
    as moed reads them: transformers' logits over a prompt longer than the window and several compression windows."""
    from moed.models.deepseek_v4_reference import forward_sequence

    path, model = tiny_v4_model
    checkpoint = HfCheckpoint(path)
    weights = {name: checkpoint.read_weight(name) for name in checkpoint.weight_keys}

    def experts(layer, e):
        prefix = f"model.layers.{layer}.ffn.experts.{e}."
        return tuple(checkpoint.source.get(prefix + w + ".weight", None) for w in ("w1", "w3", "w2"))

    ids = torch.randint(3, 64, (27,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids.view(1, -1)).logits[0]
        got = forward_sequence(checkpoint.config, weights, experts, ids)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
