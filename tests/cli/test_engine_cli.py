"""The expert-engine flags of `moed generate`, routing traces, `moed bench policy` and `moed bench bw`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.cli.main import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model("qwen2_moe", path)
    write_tiny_tokenizer(path)
    return path


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_emulated_device_generates_the_same_text_and_records_a_trace(capsys, tiny_dir, tmp_path):
    base = ["generate", "--model", str(tiny_dir), "--prompt", "The router reads", "--max-tokens", "16",
            "--ignore-eos"]
    code, cpu_text, _ = run_cli(capsys, *base)
    assert code == 0
    trace = tmp_path / "trace.jsonl"
    code, text, err = run_cli(capsys, *base, "--device", "emulated", "--cache-fraction", "0.3",
                              "--policy", "adaptive", "--trace-out", str(trace))
    assert code == 0, err
    assert text == cpu_text
    assert "[engine] device emulated, policy adaptive" in err
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {"prefill", "decode"} <= {line["phase"] for line in lines}
    moe_layers = {line["layer"] for line in lines}
    assert moe_layers == {0, 1}  # qwen2_moe tiny model: layer 1 is dense, so 2 MoE layers
    assert all(len(line["experts"]) == 2 for line in lines)

    code, table, err = run_cli(capsys, "bench", "policy", "--trace", str(trace), "--cache-fraction", "0.25,0.5")
    assert code == 0, err
    for policy in ("adaptive", "fill-all", "cpu-all", "static", "hot-set", "fixed-share", "lru-freq"):
        assert policy in table
    code, out, _ = run_cli(capsys, "bench", "policy", "--trace", str(trace), "--json", "--policies", "cpu-all")
    results = json.loads(out)["results"]
    assert results and all(r["miss_rate"] == 1.0 for r in results)


@pytest.mark.parametrize("flags,needle", [
    (["--cache-fraction", "1.5"], "cache-fraction"),
    (["--policy", "nonsense"], "nonsense"),
    (["--policy", "fixed-share:2"], "fixed-share"),
    (["--policy", "adaptive:3"], "only fixed-share"),
])
def test_bad_engine_flags(capsys, tiny_dir, flags, needle):
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x", "--device", "emulated",
                           *flags)
    assert code == 2 and needle in err and "Traceback" not in err


def test_bench_policy_rejects_a_bad_trace(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "route", "layer": 0, "experts": [1, 2], "token_pos": 0}\n{not json\n')
    code, _, err = run_cli(capsys, "bench", "policy", "--trace", str(bad))
    assert code == 2 and "2" in err and str(bad) in err


def test_bench_bw_measures_both_bandwidths(capsys, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MOED_CACHE_DIR", str(tmp_path))
    code, out, err = run_cli(capsys, "bench", "bw", "--model", str(tiny_dir), "--device", "emulated",
                             "--emulated-bp", "2", "--seconds", "0.2")
    assert code == 0, err
    assert "B_P alone" in out and "B_H alone" in out and "q*/m" in out
    assert list((tmp_path / "calibration").glob("*.json")), "profile not saved"


def test_bench_bw_measures_copies_from_the_pinned_bank_and_gives_everything_back(capsys, tiny_dir, tmp_path,
                                                                                  monkeypatch):
    """B_P is measured as serving copies (from pinned memory); the pinning and the slots are released after."""
    from moed.devices.emulated import emulated_device_bytes
    from moed.devices.pinning import pinned_bytes_now
    from moed.experts import calibration

    monkeypatch.setenv("MOED_CACHE_DIR", str(tmp_path))
    real, seen = calibration.calibrate, []

    def spy(device, bank, **kw):
        seen.append(pinned_bytes_now())
        return real(device, bank, **kw)

    monkeypatch.setattr(calibration, "calibrate", spy)
    pinned_before, device_before = pinned_bytes_now(), emulated_device_bytes()
    code, out, err = run_cli(capsys, "bench", "bw", "--model", str(tiny_dir), "--device", "emulated",
                             "--emulated-bp", "2", "--seconds", "0.1", "--no-save")
    assert code == 0, err
    assert seen and seen[0] > pinned_before, "the bank was not pinned while B_P was measured"
    assert pinned_bytes_now() == pinned_before and emulated_device_bytes() <= device_before


def test_status_says_where_the_non_expert_model_runs(capsys):
    from moed.cli.client_cmds import print_status
    from moed.v1 import control_pb2

    print_status(control_pb2.Status(state="idle", engine=control_pb2.EngineFigures(
        device="emulated", policy="adaptive", model_device_bytes=1_730_000_000, streamed_layers=12)))
    print_status(control_pb2.Status(state="idle", engine=control_pb2.EngineFigures(
        device="cuda", policy="adaptive", model_note="weights are kept packed")))
    print_status(control_pb2.Status(state="idle", engine=control_pb2.EngineFigures(device="cpu", policy="cpu-all")))
    print_status(control_pb2.Status(state="idle", engine=control_pb2.EngineFigures(
        device="cpu", policy="cpu-all", kv_blocks=512, kv_block_size=16, kv_used_blocks=40, kv_cached_blocks=30,
        kv_bytes=3 << 30, prompt_tokens=1000, cached_prompt_tokens=750, kv_evicted_blocks=2, kv_preempted=1,
        prefix_cache=True)))
    out = capsys.readouterr().out
    assert ("KV pool 40/512 blocks of 16 tokens (3.22 GB), 1 preemptions | prefix cache 30 blocks, 750 of 1000 "
            "prompt tokens reused (75%), 2 blocks evicted") in out
    assert "model on the device (1.73 GB weights + KV cache) | prefill layers streamed 12" in out
    assert "model on the host (weights are kept packed)" in out
    assert out.count("model on the") == 2  # nothing of the kind for the cpu backend
