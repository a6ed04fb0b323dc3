"""Kimi's tiktoken vocabulary (tiktoken.model + tokenizer_config.json, no tokenizer.json) read by moed's tokenizer,
checked against tiktoken itself with Moonshot's pattern (what tokenization_kimi.py builds)."""

from __future__ import annotations

import base64
import json

import pytest

from helpers.kimi_pattern import KIMI_PAT_STR
from moed.errors import ModelFormatError
from moed.text.tiktoken_vocab import RESERVED_SPECIAL_TOKENS
from moed.text.tokenizer import Tokenizer

tiktoken = pytest.importorskip("tiktoken")

TEXTS = ["Hello World! I'm here, they'LL see.", "中文测试和English混合 日本語のテキスト", "numbers 1234567 and 3.14",
         "  spaces\n\n\ttabs\r\n end ", "ÄÖÜ straße İstanbul", "def add(a, b):\n    return a + b\n", "🙂 emoji ✓",
         "the the the theme thermal other"]
NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_middle|>"}


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    """A small tiktoken BPE trained by tiktoken's own trainer on text like the tests', saved as Kimi ships it."""
    from tiktoken._educational import bpe_train

    corpus = "\n".join(TEXTS * 3 + ["the quick brown fox jumps over the lazy dog " * 4, "その他のテキスト 汉字 漢字 " * 3])
    ranks = bpe_train(corpus, 400, "(?V1)" + KIMI_PAT_STR, visualise=None)  # the regex module reads && in V1
    root = tmp_path_factory.mktemp("kimi")
    # the file format tiktoken's load_tiktoken_bpe reads (its dump needs blobfile): base64 token, rank
    (root / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    base = len(ranks)
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]", "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {str(base + k): {"content": v, "special": True} for k, v in NAMED.items()}}))
    return root, ranks


def test_kimis_tiktoken_vocabulary_tokenises_as_tiktoken_does(kimi_dir):
    root, ranks = kimi_dir
    base = len(ranks)
    specials = {NAMED.get(i - base, f"<|reserved_token_{i}|>"): i for i in range(base, base + RESERVED_SPECIAL_TOKENS)}
    reference = tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                  special_tokens=specials)
    ours = Tokenizer(root)
    for text in TEXTS + ["unseen wörds ЖЖЖ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]:
        expected = reference.encode(text)
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == text, text
    # the special tokens by name, reserved ones included, as tiktoken reads them in text it is allowed to
    text = "[BOS]hi<|im_end|>there<|reserved_token_%d|>" % (base + 9)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, allowed_special="all")
    assert ours.bos_token == "[BOS]" and ours.eos_token == "[EOS]"


@pytest.mark.parametrize("content, message", [
    (b"aGVsbG8= 0\nd29ybGQ=\n", "not a base64 token and its rank"),
    (b"aGVsbG8= 0\n!!!! 1\n", "not a base64 token and its rank"),
    (b"aGVsbG8= 0\naGVsbG8= 1\n", "repeats a token"),
    (b"aGVsbG8= 0\nd29ybGQ= 5\n", "not 0 .. n-1"),
    ("é 0\n".encode(), "cannot be read"),
])
def test_a_broken_tiktoken_file_is_a_one_line_error(tmp_path, content, message):
    (tmp_path / "tiktoken.model").write_bytes(content)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match=message):
        Tokenizer(tmp_path)


def test_a_kimi_checkpoint_directory_without_tokenizer_json_loads_with_its_tokenizer(kimi_dir, tmp_path):
    """A Kimi-Linear directory as Moonshot ships it (tiktoken.model, tokenizer_config.json, no tokenizer.json)
    loads with its tokenizer: prompts encode as tiktoken does and the model runs on them."""
    import shutil

    import torch

    from helpers.tiny_models import build_tiny_model, tiny_config
    from moed.engine.runtime import open_runtime

    root, ranks = kimi_dir
    cfg = tiny_config("kimi_linear")
    cfg.vocab_size = len(ranks) + RESERVED_SPECIAL_TOKENS
    model_dir = tmp_path / "kimi-linear"
    reference = build_tiny_model("kimi_linear", model_dir, config=cfg).eval()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(root / name, model_dir / name)
    assert not (model_dir / "tokenizer.json").exists()
    runtime = open_runtime(model_dir, weights_dtype="fp32")
    try:
        ids = runtime.encode_prompt("Hello World! 中文", chat=False)
        encoding = tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
        assert ids == encoding.encode("Hello World! 中文")
        from moed.runner.forward_batch import ForwardBatch

        logits = runtime.model.forward(ForwardBatch.from_token_lists([ids], [0], [0]), runtime.model.new_cache(1, 64),
                                       last_only=False)[0]
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        assert (logits - expected).abs().max().item() < 1e-3 * max(1.0, expected.abs().max().item())
    finally:
        runtime.close()
