"""`moed generate` / `moed convert` end to end on a tiny model, and every bad input as a clear error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.cli.main import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-mixtral")
    build_tiny_model("mixtral", path)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tiny_ftw(tiny_dir, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("ftw") / "model"
    assert main(["convert", str(tiny_dir), str(dst), "--experts-dtype", "fp32"]) == 0
    return dst


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_generate_streams_text_and_reports_speed(capsys, tiny_dir):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--prompt", "The router reads",
                             "--max-tokens", "12", "--ignore-eos")
    assert code == 0, err
    assert out.strip(), "no text was streamed"
    assert "TTFT" in err and "tok/s" in err and "generated 12 tok" in err


def test_generate_is_reproducible_with_a_seed_and_chat_mode_works(capsys, tiny_ftw):
    args = ["generate", "--model", str(tiny_ftw), "--prompt", "hello", "--chat", "--temperature", "0.9",
            "--top-p", "0.9", "--seed", "5", "--max-tokens", "10", "--ignore-eos"]
    first = run_cli(capsys, *args)
    second = run_cli(capsys, *args)
    assert first[0] == 0 and first[1] == second[1]


def test_stop_string_truncates_output(capsys, tiny_dir):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--prompt", "The router reads",
                             "--max-tokens", "30", "--ignore-eos")
    text = out.rstrip("\n")
    # the first two-character window from the middle on that has no whitespace and occurs there first
    middle = len(text) // 2
    starts = [i for i in range(middle, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2]
              and text.index(text[i:i + 2]) == i]
    assert starts, f"the tiny model's 30 tokens give no usable stop string: {text!r}"
    stop = text[starts[0]:starts[0] + 2]
    code, out2, err2 = run_cli(capsys, "generate", "--model", str(tiny_dir), "--prompt", "The router reads",
                               "--max-tokens", "30", "--ignore-eos", "--stop", stop)
    assert code == 0 and "[stop]" in err2
    assert out2.rstrip("\n") == text[: text.index(stop)]


@pytest.mark.parametrize("flag,value,field", [
    ("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"), ("--top-k", "-3", "top_k"),
    ("--min-p", "1.5", "min_p"), ("--repetition-penalty", "0", "repetition_penalty"),
    ("--max-tokens", "0", "max_tokens"),
])
def test_invalid_sampling_parameters(capsys, tiny_dir, flag, value, field):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x", flag, value)
    assert code == 2 and field in err and "Traceback" not in err


def test_prompt_longer_than_context(capsys, tiny_dir):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--prompt", "the weights " * 40,
                           "--context", "16")
    assert code == 2 and "context" in err and "tokens" in err


def test_unsupported_architecture_lists_supported_ones(capsys, tiny_dir, tmp_path):
    bad = copy_model(tiny_dir, tmp_path / "llama")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "generate", "--model", str(bad), "--prompt", "x")
    assert code == 2 and "'llama' is not supported" in err
    for arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                 "DeepseekV3ForCausalLM", "GptOssForCausalLM"):
        assert arch in err


def test_config_and_weights_that_do_not_match(capsys, tiny_dir, tmp_path):
    bad = copy_model(tiny_dir, tmp_path / "mismatch")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # the checkpoint has 2
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "generate", "--model", str(bad), "--prompt", "x")
    assert code == 2 and "k_proj.weight" in err and "do not belong together" in err


@pytest.mark.parametrize("damage", ["missing_dir", "no_config", "bad_json", "no_weights", "garbage_weights",
                                    "truncated_weights", "no_tokenizer_config"])
def test_missing_or_corrupt_hf_files(capsys, tiny_dir, tmp_path, damage):
    bad = copy_model(tiny_dir, tmp_path / "bad")
    weights = bad / "model.safetensors"
    if damage == "missing_dir":
        shutil.rmtree(bad)
    elif damage == "no_config":
        (bad / "config.json").unlink()
    elif damage == "bad_json":
        (bad / "config.json").write_text("{not json")
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "garbage_weights":
        weights.write_bytes(b"\x00garbage" * 100)
    elif damage == "truncated_weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "no_tokenizer_config":
        (bad / "tokenizer_config.json").unlink()
    code, _, err = run_cli(capsys, "generate", "--model", str(bad), "--prompt", "x", "--max-tokens", "2")
    assert code == 2, err
    assert "Traceback" not in err and "moed: error:" in err
    assert str(bad) in err or damage == "missing_dir" and "not found" in err


def test_truncated_and_corrupt_ftw_shards(capsys, tiny_ftw, tmp_path):
    bad = copy_model(tiny_ftw, tmp_path / "ftw-trunc")
    shard = sorted(bad.glob("shard-*.bin"))[0]
    data = bytearray(shard.read_bytes())
    shard.write_bytes(data[: len(data) - 4096])
    code, _, err = run_cli(capsys, "generate", "--model", str(bad), "--prompt", "x")
    assert code == 2 and shard.name in err

    flipped = copy_model(tiny_ftw, tmp_path / "ftw-flip")
    shard = sorted(flipped.glob("shard-*.bin"))[0]
    index = json.loads((flipped / "ftw.json").read_text())
    name, entry = next((n, t) for n, t in index["tensors"].items() if t["file"] == shard.name and t["size"] > 64)
    data = bytearray(shard.read_bytes())
    data[entry["offset"] + 17] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "generate", "--model", str(flipped), "--prompt", "x", "--verify")
    assert code == 2 and name in err


def test_convert_refuses_to_overwrite_without_force(capsys, tiny_dir, tiny_ftw):
    code, _, err = run_cli(capsys, "convert", str(tiny_dir), str(tiny_ftw))
    assert code == 2 and "--force" in err


def test_errors_exit_2_without_traceback_in_a_real_process(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moed.cli.main", "generate", "--model", str(tmp_path / "nope"),
                           "--prompt", "x"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("moed: error:") and "Traceback" not in proc.stderr
