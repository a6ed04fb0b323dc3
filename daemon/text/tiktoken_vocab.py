"""A tokenizers-library tokenizer (tokenizer.json form) rebuilt from a tiktoken BPE file: Moonshot's Kimi-K2 and
Kimi-Linear checkpoints ship ``tiktoken.model`` and Python code (``tokenization_kimi.py``), no tokenizer.json.

A tiktoken file holds one token per line, its bytes in base64 and its rank. tiktoken's BPE merges, at each step,
the adjacent pair whose concatenation has the lowest rank, and takes a piece that is a token whole. The same
tokenizer in the tokenizers library is a byte-level BPE (bytes spelled with GPT-2's printable table) whose merges
are every split of every token into two tokens, ranked by the merged token's rank, with ``ignore_merges`` (a piece
that is a token is that token): how transformers' ``TikTokenConverter`` builds it (transformers is a test
dependency of moed, not a runtime one, hence this module; the tests check the result against tiktoken itself).

Text is split before BPE by Kimi's pattern (``KIMI_PATTERN``, tokenization_kimi.py's ``pat_str``). Special tokens
follow the base tokens: ``tokenization_kimi.py`` reserves 256 ids, named by tokenizer_config.json's
``added_tokens_decoder`` where it names them and ``<|reserved_token_{id}|>`` otherwise.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moed.errors import ModelFormatError, quoted

TIKTOKEN_FILE = "tiktoken.model"
RESERVED_SPECIAL_TOKENS = 256  # tokenization_kimi.py's num_reserved_special_tokens
MAX_FILE_BYTES = 64 << 20  # Kimi's is 2.8 MB; a bound so a hostile file cannot exhaust memory

# tokenization_kimi.py's pat_str: Han runs apart from other letters, cased words in pieces, numbers in threes
# ("&&" is a character class intersection, which the tokenizers library's regex engine reads as such)
KIMI_PATTERN = (r"[\p{Han}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_spelling() -> list[str]:
    """GPT-2's byte -> printable character table (what a byte-level BPE's vocabulary is written in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def read_ranks(path: Path) -> dict[bytes, int]:
    """The tokens and ranks of a tiktoken file; a malformed file is a one-line error naming the line."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ModelFormatError(f"{path}: {size} bytes is more than a tiktoken vocabulary holds "
                                   f"({MAX_FILE_BYTES >> 20} MiB at most); it is not one")
        text = path.read_bytes().decode("ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{path}: cannot be read as a tiktoken vocabulary ({exc}); download it again") from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("not a token and a rank")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as exc:
            raise ModelFormatError(f"{path}: line {number} ({quoted(line, 80)}) is not a base64 token and its rank "
                                   f"({exc}); the file is corrupt, download it again") from None
        if not token or token in ranks or rank < 0:
            raise ModelFormatError(f"{path}: line {number} repeats a token or gives an empty one or a negative rank; "
                                   "the file is corrupt, download it again")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))) or len(ranks) < 256:
        raise ModelFormatError(f"{path}: the ranks are not 0 .. n-1 over at least every single byte; the file is "
                               "corrupt or not a tiktoken BPE vocabulary")
    return ranks


def special_tokens(num_base: int, config: Mapping[str, Any], where: str) -> dict[int, str]:
    """The reserved special tokens after the base ones: tokenizer_config.json's names, the rest reserved."""
    named = config.get("added_tokens_decoder") or {}
    if not isinstance(named, Mapping):
        raise ModelFormatError(f"{where}: added_tokens_decoder should map token ids to tokens")
    out = {}
    for token_id in range(num_base, num_base + RESERVED_SPECIAL_TOKENS):
        entry = named.get(str(token_id))
        content = entry.get("content") if isinstance(entry, Mapping) else None
        out[token_id] = content if isinstance(content, str) and content else f"<|reserved_token_{token_id}|>"
    extra = [k for k in named if not str(k).isdigit() or not num_base <= int(k) < num_base + RESERVED_SPECIAL_TOKENS]
    if extra:
        raise ModelFormatError(f"{where}: added_tokens_decoder names ids {extra[:5]} outside the "
                               f"{RESERVED_SPECIAL_TOKENS} special ids after the {num_base} base tokens")
    return out


def added_token(token_id: int, content: str, special: bool) -> dict[str, Any]:
    """One ``added_tokens`` entry of a tokenizer.json: matched whole in the text before any splitting."""
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def tiktoken_tokenizer_json(path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizers-library JSON of the tiktoken vocabulary at ``path`` with Kimi's split and the special
    tokens ``config`` (tokenizer_config.json) names (module docstring)."""
    ranks = read_ranks(path)
    spell = _byte_spelling()

    def spelled(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    vocab = {spelled(token): rank for token, rank in ranks.items()}
    specials = special_tokens(len(ranks), config, str(path.parent / "tokenizer_config.json"))
    added = []
    for token_id, content in specials.items():
        vocab.setdefault(content, token_id)
        added.append(added_token(token_id, content, True))
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": KIMI_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": [[spelled(left), spelled(right)] for *_, left, right in merges]},
    }
