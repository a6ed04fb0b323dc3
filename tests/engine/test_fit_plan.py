"""`moed fit`: the plan of a model for machines of given RAM and VRAM, from its config alone (GLM-5 and
DeepSeek-V3.2 at their real sizes: transformers' default configs are theirs) or from a checkpoint."""

from __future__ import annotations

import json

import pytest

from helpers.tiny_models import build_tiny_model
from moed.cli.main import main
from moed.engine.fit_plan import GB, fit_machine, host_reserve, model_needs
from moed.service.memory_governor import GovernorConfig


def _config_file(tmp_path, config, name="config.json", **changes):
    cls = type(config).__name__.replace("Config", "ForCausalLM")
    path = tmp_path / name
    path.write_text(json.dumps({**config.to_dict(), "architectures": [cls], **changes}))
    return path


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    import transformers as tf

    return _config_file(tmp_path_factory.mktemp("glm5"), tf.GlmMoeDsaConfig())  # zai-org/GLM-5's sizes


@pytest.fixture(scope="module")
def qwen3_30b(tmp_path_factory):
    import transformers as tf

    config = tf.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960)
    return _config_file(tmp_path_factory.mktemp("qwen3"), config)


def test_glm5_from_its_config_alone(glm5):
    needs = model_needs(glm5)
    assert needs.family == "glm_moe_dsa" and needs.source == "config.json alone"
    assert 740e9 < needs.total_params < 750e9 and 40e9 < needs.active_params < 42e9  # "744B, 40B active"
    # per token and layer: the 512-value latent, 64 rotary values and the indexer's 128-value key, in bf16
    assert needs.kv_bytes_per_token == 78 * (512 + 64 + 128) * 2
    assert needs.load.bank_dtype == "bf16" and needs.load.bank_bytes > 1400 * GB
    for ram in (24, 64, 128):
        for vram in (0, 8, 16, 32):
            fit = fit_machine(needs, ram * GB, vram * GB)
            assert not fit.runs and "GB of RAM" in fit.where and not fit.hint, (ram, vram)
    int4 = model_needs(glm5, "int4")
    fit = fit_machine(int4, 1024 * GB, 96 * GB)
    assert fit.runs and fit.where == "gpu" and fit.context == 202752
    assert fit.expert_cache_bytes > 0


def test_deepseek_v32_from_its_config_alone(tmp_path):
    import transformers as tf

    needs = model_needs(_config_file(tmp_path, tf.DeepseekV32Config()))
    assert 670e9 < needs.total_params < 673e9 and 36e9 < needs.active_params < 38.5e9  # "671B, 37B active"
    assert needs.kv_bytes_per_token == 61 * (512 + 64 + 128) * 2
    fit = fit_machine(needs, 512 * GB, 0)
    assert not fit.runs and fit.hint.startswith("fits with --experts-dtype int4")


def test_a_30b_model_on_desktop_machines(qwen3_30b):
    needs = model_needs(qwen3_30b)
    assert 30e9 < needs.total_params < 31e9 and 3.0e9 < needs.active_params < 3.5e9
    cpu = fit_machine(needs, 128 * GB, 0)
    assert cpu.runs and cpu.where == "cpu" and cpu.context == 40960 and cpu.expert_cache_bytes == 0
    small = fit_machine(needs, 24 * GB, 8 * GB)
    assert not small.runs and "fits with --experts-dtype mxfp4" in small.hint
    gpu = fit_machine(needs, 128 * GB, 16 * GB)
    vram = 16 * GB - GovernorConfig().headroom(16 * GB)
    assert gpu.runs and gpu.where == "gpu" and gpu.context == 40960
    assert gpu.expert_cache_bytes == vram - needs.load.weight_bytes - needs.device_step_bytes - gpu.kv_bytes
    assert gpu.host_bytes <= 128 * GB - host_reserve(128 * GB)
    # a GPU too small for the other weights caches experts only; the rest stays on the host
    tiny_gpu = fit_machine(needs, 128 * GB, 2 * GB)
    assert tiny_gpu.runs and tiny_gpu.where == "cpu+gpu cache" and tiny_gpu.expert_cache_bytes > 0


def test_the_config_alone_plans_what_the_checkpoint_plans(tmp_path):
    build_tiny_model("deepseek_v32", tmp_path / "hf")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    real, alone = model_needs(tmp_path / "hf"), model_needs(tmp_path / "cfg")
    assert real.source == "the checkpoint's headers" and alone.source == "config.json alone"
    assert alone.load.weight_bytes == real.load.weight_bytes > 0
    assert alone.load.bank_bytes_by_dtype == real.load.bank_bytes_by_dtype
    assert (alone.total_params, alone.kv_bytes_per_token) == (real.total_params, real.kv_bytes_per_token)


def test_an_nvfp4_config_keeps_its_blocks_on_the_cpu_and_goes_int4_with_a_gpu(qwen3_30b, tmp_path):
    raw = json.loads(qwen3_30b.read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}))
    cpu, gpu = model_needs(path, cpu_only=True), model_needs(path, cpu_only=False)
    assert cpu.load.bank_dtype == "ggml" and gpu.load.bank_dtype == "int4"
    rows = 48 * 128 * 3 * 2048 * 768
    assert cpu.load.bank_bytes == rows // 64 * 36 + 48 * 128 * 3 * 4  # 4.5 bits a weight, a factor per matrix


def test_the_cli_prints_the_table_and_refuses_what_it_cannot_plan(glm5, tmp_path, capsys):
    assert main(["fit", str(glm5), "--ram", "24,1024", "--vram", "0,96", "--experts-dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "glm_moe_dsa: 78 layers, 256 experts (top 8)" in out and "107.2 KiB per token" in out
    lines = [line for line in out.splitlines() if " GB " in line and ("yes" in line or " no " in line)]
    assert len(lines) == 4 and sum(" yes " in line for line in lines) == 2
    with pytest.raises(SystemExit):
        main(["fit", str(glm5), "--ram", "lots"])
    assert "give sizes in GB" in capsys.readouterr().err
    v4 = tmp_path / "v4.json"  # a config that names its family and nothing else: the first missing field
    v4.write_text(json.dumps({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}))
    assert main(["fit", str(v4)]) == 2
    assert "required field 'num_hidden_layers' is missing" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_type": "jamba", "architectures": ["JambaForCausalLM"]}))
    assert main(["fit", str(other)]) == 2
    assert "'jamba' is not supported" in capsys.readouterr().err
    assert main(["fit", str(tmp_path / "missing")]) == 2


def test_a_gguf_whose_linears_stay_packed_keeps_the_model_on_the_host(tmp_path):
    """A quantised GGUF's attention weights load packed, which the device path cannot multiply: with a GPU
    the plan caches experts there and keeps the model on the host (an F32 file's model may move)."""
    from gguf import GGMLQuantizationType as T

    from helpers.gguf_writer import write_tiny_gguf

    quantised = write_tiny_gguf("qwen3_moe", tmp_path / "q", expert_type=T.Q8_0, weight_type=T.Q8_0)[0]
    plain = write_tiny_gguf("qwen3_moe", tmp_path / "f", expert_type=T.F32, weight_type=T.F32)[0]
    assert model_needs(quantised, cpu_only=False).packed_weights and not model_needs(plain).packed_weights
    assert fit_machine(model_needs(quantised, cpu_only=False), 64 * GB, 16 * GB).where == "cpu+gpu cache"
    assert fit_machine(model_needs(plain, cpu_only=False), 64 * GB, 16 * GB).where == "gpu"


def test_an_fp8_deepseek_config_keeps_its_linears_fp8_on_the_cpu(tmp_path):
    """DeepSeek-V3.2 as published (FP8, 128 x 128 blocks): a CPU-only plan counts its attention and dense
    linears at one byte a weight (kept as stored), a plan with a GPU at bf16's two."""
    import transformers as tf

    path = _config_file(tmp_path, tf.DeepseekV32Config(), quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    cpu, gpu = model_needs(path, cpu_only=True), model_needs(path, cpu_only=False)
    assert cpu.load.weight_bytes < 0.75 * gpu.load.weight_bytes


@pytest.mark.parametrize("family", ["nemotron_h", "gemma4_text", "llama4_text", "kimi_linear"])
def test_the_parameter_count_is_transformers_own(family, tmp_path):
    """Every weight of the checkpoint counted once, whatever the family's layout (Nemotron-H's non-gated experts,
    Gemma-4's experts beside a dense MLP, Llama-4's fused experts, Kimi-Linear's KDA layers): the parameters and the
    saved buffers (router correction biases, Gemma-4's layer scales) of transformers' model."""
    reference = build_tiny_model(family, tmp_path)
    tensors = {t.data_ptr(): t.numel() for t in reference.state_dict().values() if t.is_floating_point()}
    assert model_needs(tmp_path).total_params == sum(tensors.values())
