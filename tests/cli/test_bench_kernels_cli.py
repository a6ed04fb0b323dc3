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
    assert set(parser.parse_args(["bench", "kernels"]).dtypes.split(",")) == set(EXPERT_DTYPES)
    assert {"q8", "mxfp4"} <= set(EXPERT_DTYPES)


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
