"""Builds a tiny Hugging Face-style byte-level BPE tokenizer dir from local text, for tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
# Order fixes the ids: specials come first (0..3), then the 256 byte symbols, then merges.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, IM_START_TOKEN, EOS_TOKEN)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SUBJECTS = (
    "The model", "A small expert", "The daemon", "Every token", "The router", "Our cache",
    "The user", "This layer", "The GPU", "A quick brown fox", "The scheduler", "My friend",
)
_VERBS = (
    "reads", "writes", "loads", "streams", "routes", "computes", "skips", "finds",
    "jumps over", "decodes", "samples", "keeps",
)
_OBJECTS = (
    "the weights", "a lazy dog", "the next expert", "many bytes", "the prompt", "a long answer",
    "the hidden state", "three numbers", "the café menu", "the 日本 text", "every request", "the file",
)
_TAILS = (
    "quickly.", "again and again.", "without a pause!", "in 12 ms.", "before noon?", "(twice).",
    "from disk; then it waits.", "at 3.14 GB/s.", "with 100% care.", "— and that is fine.",
)
# Fixed lines so that digits, punctuation and multi-byte UTF-8 (2, 3 and 4 bytes) are all seen.
_FIXED_LINES = (
    "0123456789 +-*/=<>()[]{} .,;:!?'\"@#$%^&_|~`\\",
    "Numbers: 1, 22, 333, 4444, 55555 and 3.14159; 2024-01-31 at 10:45.",
    "Un café à Paris, s'il vous plaît. Résumé: déjà vu, naïve, élève.",
    "日本語のテキスト。東京は日本の首都です。",
    "Emoji test: 🙂 🚀 ✓ — “quotes” and ‘more’ … done.",
    "def add(a, b):\n    return a + b\n",
)


def _training_lines(n_sentences: int = 220) -> list[str]:
    # A seeded local RNG keeps the corpus (hence the vocab and merges) identical on every run.
    rng = random.Random(1234)
    lines = [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        for _ in range(n_sentences)
    ]
    return lines + list(_FIXED_LINES) * 3


def build_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train the byte-level BPE in memory (no files); ~50 ms."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_lines(), trainer=trainer)
    return tok


def write_tiny_tokenizer(dst_dir: Path, vocab_size: int = 512) -> Path:
    """Write tokenizer.json + tokenizer_config.json (ChatML template) into dst_dir and return dst_dir.

    Special tokens: pad "<|endoftext|>"=0, bos "<s>"=1, "<|im_start|>"=2, eos "<|im_end|>"=3.
    add_bos_token is false (ChatML models such as Qwen do not prepend a BOS).
    """
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(vocab_size).save(str(dst_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }
    (dst_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    return dst_dir
