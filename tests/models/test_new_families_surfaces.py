"""The families of issue #36 through the user-facing paths: `moed generate` prints transformers' 32 greedy tokens,
and the HTTP API answers them (up to the first end token, where the API stops)."""

from __future__ import annotations

import pytest

from helpers.reference_parity import expected_greedy
from helpers.tiny_models import build_tiny_model_dir

FAMILIES = ("glm4_moe_lite", "ernie4_5_moe", "minimax_m2", "llama4_text", "nemotron_h", "gemma4_text",
            "kimi_linear")
PROMPT = "The router reads the weights again and again, then the scheduler finds a long answer"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("new-families")
    for family in FAMILIES:
        build_tiny_model_dir(root, family, family)
    return root


@pytest.fixture(scope="module")
def expected(models_dir):
    return {family: expected_greedy(models_dir / family, PROMPT) for family in FAMILIES}


def test_cli_generate_prints_transformers_greedy_text(models_dir, expected, capsys):
    from moed.cli.main import main

    for family in FAMILIES:
        code = main(["generate", "--model", str(models_dir / family), "--prompt", PROMPT, "--max-tokens", "32",
                     "--ignore-eos"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert out.strip() == expected[family][1].strip(), family


def test_the_http_api_answers_transformers_greedy_text(models_dir, expected):
    from helpers.http_daemon import start_http_daemon
    from moed.text.tokenizer import Tokenizer

    daemon = start_http_daemon(models_dir, models=FAMILIES)
    try:
        client = daemon.openai()
        for family in FAMILIES:
            answer = client.completions.create(model=family, prompt=PROMPT, max_tokens=32, temperature=0)
            tokens, _ = expected[family]
            tok = Tokenizer(models_dir / family)
            eos = set(tok.eos_token_ids) | {2}  # the tokenizer's and config.json's
            end = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
            assert answer.usage.completion_tokens == min(end + 1, 32), family
            assert answer.choices[0].text == tok.decode(tokens[:end]), family
    finally:
        daemon.close()
