"""The device check's real-shape script (benchmarks/gpu_real_shape.py) runs end to end on the emulated device.

The script is what a session with a lent GPU runs in its few device minutes; a break found there costs
a whole run. Here it runs at toy size: every section completes and reports its figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_real_shape_script_runs_on_the_emulated_device(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_real_shape

    report = tmp_path / "real_shape.json"
    gpu_real_shape.main(["--device", "emulated", "--layers", "2", "--experts", "16", "--inter", "128",
                              "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                              "--vocab", "1000", "--caps", "0.0015,0.003", "--reserve-mib", "0", "--tokens", "6",
                              "--prefill", "200", "--experts-dtype", "bf16", "--sections", "parity,decode,syncs,prefill",
                              "--json", str(report)])
    out = json.loads(report.read_text())
    assert [r["policy"] for r in out["parity"]] == ["adaptive", "fill-all", "static-layers"]
    assert all(r["steps"] == 33 for r in out["parity"])
    assert {(r["cap_gib"], r["policy"]) for r in out["decode"]} == {
        (c, p) for c in (0.0015, 0.003) for p in ("adaptive", "fill-all", "static-layers")}
    assert all(r["finish"] == "length" and len(r["tokens"]) == 6 for r in out["decode"])
    assert out["syncs"]["per_step"] == 3  # 2 MoE layers + the logits
    assert [(r["tokens"], r["buffers"]) for r in out["prefill"]] == [(200, 2), (200, 1)]
    sys.modules.pop("gpu_real_shape", None)


def test_the_q4_k_m_ggml_bank_runs_through_the_same_script(tmp_path, monkeypatch):
    """gpu_check.sh's ggml step: a Q4_K_M file's bank (Q4_K gate/up, Q6_K down in llama.cpp's "more bits"
    layers) decodes under every placement; the tokens are cpu-all's, whose CPU path runs the native kernels:
    checked here only for completing (the native int8 activations may flip a sampled draw)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_real_shape

    report = tmp_path / "real_shape.json"
    gpu_real_shape.main(["--device", "emulated", "--layers", "3", "--experts", "8", "--inter", "256",
                         "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                         "--vocab", "1000", "--caps", "0.012", "--reserve-mib", "0", "--tokens", "4",
                         "--experts-dtype", "ggml-q4_k_m", "--sections", "decode", "--json", str(report)])
    out = json.loads(report.read_text())
    assert {r["policy"] for r in out["decode"]} == {"adaptive", "fill-all", "static-layers"}
    assert all(r["finish"] == "length" and len(r["tokens"]) == 4 for r in out["decode"])
    assert any(r["fills"] > 0 for r in out["decode"])
    sys.modules.pop("gpu_real_shape", None)
