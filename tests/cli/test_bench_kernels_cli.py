"""`moed bench kernels`: every bank dtype is offered, bad dtypes and shapes are one clear line, a small run works."""

from __future__ import annotations

import json

import pytest

from moed.cache.expert_dtypes import EXPERT_DTYPES
from moed.cli.main import build_parser, main


def test_every_bank_dtype_is_a_choice_everywhere() -> None:
    parser = build_parser()
    for argv in (["generate", "--model", "m", "--prompt", "p"], ["convert", "a", "b"], ["bench", "bw", "--model", "m"]):
        for dtype in EXPERT_DTYPES:
            assert parser.parse_args([*argv, "--experts-dtype", dtype]).experts_dtype == dtype
    assert parser.parse_args(["bench", "kernels"]).dtypes == ""  # every bank dtype and every ggml:TYPE
    assert {"q8", "mxfp4"} <= set(EXPERT_DTYPES)
    for argv in (["generate", "--model", "m", "--prompt", "p"], ["bench", "bw", "--model", "m"]):
        assert parser.parse_args([*argv, "--experts-dtype", "ggml"]).experts_dtype == "ggml"


def test_the_ggml_types_are_benchmarked_where_their_blocks_fit() -> None:
    from moed.experts.kernel_bench import bench_kernels, ggml_bench_dtypes, ggml_shape_ok

    kept = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
            "MXFP4", "NVFP4", "FP8_B128", "MXFP8"}  # the last two: moed's FP8 types (FP8 / MXFP8 checkpoints)
    assert set(ggml_bench_dtypes()) == {"ggml:" + name for name in kept}
    assert ggml_shape_ok("ggml:Q4_K", 512, 256) and not ggml_shape_ok("ggml:Q4_K", 576, 1536)
    rows = bench_kernels([(256, 256), (96, 64)], ["ggml:Q6_K", "ggml:Q8_0", "ggml:FP8_B128", "ggml:MXFP8"],
                         bank_bytes=4 * 2**20, read_bytes=2**20, trials=1)
    assert [(r["dtype"], r["hidden"]) for r in rows] == [("ggml:Q6_K", 256), ("ggml:Q8_0", 256), ("ggml:Q8_0", 96),
                                                         ("ggml:FP8_B128", 256), ("ggml:MXFP8", 256), ("ggml:MXFP8", 96)]
    assert all(r["weight_gbps"] > 0 and r["bytes_per_expert"] > 0 for r in rows)


@pytest.mark.parametrize("argv, match", [
    (["--dtypes", "int3"], "not among"),
    (["--dtypes", "q8", "--shapes", "48x64"], "multiples of 32"),
    (["--dtypes", "bf16,mxfp4", "--shapes", "64x40"], "mxfp4"),
])
def test_bad_dtypes_and_shapes_are_one_line(capsys, argv: list[str], match: str) -> None:
    assert main(["bench", "kernels", *argv]) != 0
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_a_small_run_measures_q8_and_mxfp4(capsys, monkeypatch) -> None:
    from moed.experts import kernel_bench

    real = kernel_bench.bench_kernels
    monkeypatch.setattr(kernel_bench, "bench_kernels",
                        lambda shapes, dtypes: real(shapes, dtypes, bank_bytes=2**20, read_bytes=8 * 2**20, trials=1))
    assert main(["bench", "kernels", "--dtypes", "q8,mxfp4", "--shapes", "64x32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["dtype"] for r in rows] == ["q8", "mxfp4"]
    assert all(r["weight_gbps"] > 0 and r["hidden"] == 64 and r["intermediate"] == 32 for r in rows)


def test_dense_gemvs_are_measured_on_request(capsys, monkeypatch) -> None:
    from moed.experts import kernel_bench
    from moed.kernels.native_cpu import native

    if native() is None:
        pytest.skip("native CPU kernels not built")
    monkeypatch.setattr(kernel_bench, "bench_kernels", lambda shapes, dtypes: [])
    real = kernel_bench.bench_dense
    monkeypatch.setattr(kernel_bench, "bench_dense",
                        lambda shapes: real(shapes, total_bytes=2**20, read_bytes=8 * 2**20, trials=1))
    assert main(["bench", "kernels", "--dtypes", "bf16", "--shapes", "64x32", "--dense", "96x64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["dtype"] for r in rows] == ["dense bf16", "dense q8", "dense int4"]
    assert all(r["weight_gbps"] > 0 and r["hidden"] == 64 and r["intermediate"] == 96 for r in rows)
    assert main(["bench", "kernels", "--dense", "96x40"]) != 0
    assert "multiple of 32" in capsys.readouterr().err
