"""`moed generate` with extreme but valid sampling values samples; it never prints a traceback (issue #9)."""

from __future__ import annotations

import pytest

from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.cli.main import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model("mixtral", path)
    write_tiny_tokenizer(path)
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_subnormal_temperature_is_greedy_and_tiny_penalties_sample(capsys, tiny_dir):
    base = ["--model", str(tiny_dir), "--prompt", "The router reads", "--max-tokens", "6", "--ignore-eos"]
    code, greedy, err = run(capsys, *base)
    assert code == 0, err
    code, out, err = run(capsys, *base, "--temperature", "1e-40")
    assert code == 0 and "Traceback" not in err, err
    assert out == greedy
    code, out, err = run(capsys, *base, "--temperature", "0.9", "--repetition-penalty", "1e-45", "--seed", "3")
    assert code == 0 and "Traceback" not in err and "generated 6 tok" in err, err
