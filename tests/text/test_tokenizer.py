"""Tokenizer loading, encode/decode parity with transformers, BOS/EOS handling and streaming decode."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from helpers.tiny_tokenizer import BOS_TOKEN, CHATML_TEMPLATE, EOS_TOKEN, write_tiny_tokenizer
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, processors
from transformers import PreTrainedTokenizerFast

from moed.errors import InvalidRequestError, ModelFormatError
from moed.text.stream_decoder import StreamDecoder
from moed.text.tokenizer import Tokenizer

TEXTS = [
    "The model reads the weights quickly.",
    "  leading spaces and\ttabs\nnew lines  ",
    "Un café à Paris: déjà vu, naïve élève.",
    "日本語のテキスト。東京は日本の首都です。",
    "Emoji 🙂🚀 and ✓ “quotes” … done",
    "<|im_start|>user\nhi<|im_end|>\n<s>",
    "Numbers 3.14159 and 2024-01-31; x = a + b * (c - d) / 7!",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(tok_dir))


def _copy(src: Path, dst: Path, **config_updates: object) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(config_updates)
    cfg_path.write_text(json.dumps(cfg))
    return dst


def test_helper_is_deterministic(tok_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_tokenizer(tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_attributes(tok: Tokenizer, hf_tok: PreTrainedTokenizerFast) -> None:
    assert tok.bos_token == BOS_TOKEN and tok.eos_token == EOS_TOKEN
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.eos_token_id == hf_tok.eos_token_id
    assert tok.pad_token_id == hf_tok.pad_token_id
    assert tok.eos_token_ids == frozenset({hf_tok.eos_token_id})
    assert tok.vocab_size == len(hf_tok) == 512
    assert tok.model_max_length == 2048
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.add_bos_token is False
    assert {tok.bos_token_id, tok.eos_token_id} <= tok.special_token_ids


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: PreTrainedTokenizerFast, add_special: bool) -> None:
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=add_special) == hf_tok.encode(
            text, add_special_tokens=add_special
        ), text


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf_tok: PreTrainedTokenizerFast, skip: bool) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_round_trip(tok: Tokenizer) -> None:
    for text in TEXTS:
        if "<" not in text:
            assert tok.decode(tok.encode(text)) == text


def test_encode_rejects_non_string(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="prompt must be a string"):
        tok.encode(123)  # type: ignore[arg-type]


def test_add_bos_token_prepends_once(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "bos", add_bos_token=True)
    tok = Tokenizer(d)
    bos = tok.bos_token_id
    # transformers with an explicit add_bos_token rebuilds the post-processor to add exactly one BOS.
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token=BOS_TOKEN, add_bos_token=True)
    for text in ["hello world", "日本"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        assert ids[0] == bos and ids[1] != bos
        assert tok.encode(text, add_special_tokens=False)[0] != bos
    # A prompt that already starts with BOS (e.g. a rendered Llama-3 chat) does not get a second one.
    assert tok.encode(BOS_TOKEN + "hi").count(bos) == 1
    assert tok.encode("")[0:1] == [bos]


def test_post_processor_bos_not_doubled(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "pp", add_bos_token=True)
    backend = BackendTokenizer.from_file(str(d / "tokenizer.json"))
    bos_id = backend.token_to_id(BOS_TOKEN)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    backend.save(str(d / "tokenizer.json"))
    tok = Tokenizer(d)
    hf = PreTrainedTokenizerFast.from_pretrained(str(d))
    for text in ["hello world", "Un café"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        assert ids[0] == bos_id and ids.count(bos_id) == 1
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_unknown_bos_tolerated_when_not_prepended(tok_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer(_copy(tok_dir, tmp_path / "nobos", bos_token="<not-in-vocab>", pad_token=None))
    assert tok.bos_token_id is None and tok.pad_token_id is None
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_eos_ids_union_of_all_configs(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "eos")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 9, "text_config": {"eos_token_id": [11]}}))
    tok = Tokenizer(d)
    assert tok.eos_token_ids == frozenset({tok.eos_token_id, 3, 7, 9, 11})


def test_special_tokens_as_dicts_and_template_list(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(
        tok_dir,
        tmp_path / "dicts",
        bos_token={"content": BOS_TOKEN, "lstrip": False, "__type": "AddedToken"},
        eos_token={"content": EOS_TOKEN, "special": True},
        chat_template=[{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}],
        model_max_length=int(1e30),
    )
    tok = Tokenizer(d)
    assert (tok.bos_token, tok.eos_token) == (BOS_TOKEN, EOS_TOKEN)
    assert tok.chat_template == "DEFAULT"
    assert tok.model_max_length is None
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "DEFAULT"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function"}]) == "TOOLS"


def test_chat_template_jinja_file_wins(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "jinja")
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer(d)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    assert tok.chat_template_source == "chat_template.jinja"


def test_apply_chat_template_matches_transformers(tok: Tokenizer, hf_tok: PreTrainedTokenizerFast) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Un café 🙂?"}]
    prompt = tok.apply_chat_template(msgs)
    assert prompt == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.encode(prompt, add_special_tokens=False) == hf_tok.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_no_chat_template(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "notpl")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(d)
    assert tok.chat_template is None
    with pytest.raises(InvalidRequestError, match=r"no chat template; use plain prompt mode \(omit --chat\)"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --- broken model dirs -------------------------------------------------------------------------


def test_missing_files(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="tokenizer.json: file not found"):
        Tokenizer(tmp_path)
    d = _copy(tok_dir, tmp_path / "nocfg")
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(ModelFormatError, match="tokenizer_config.json: file not found"):
        Tokenizer(d)


def test_corrupt_tokenizer_json(tok_dir: Path, tmp_path: Path) -> None:
    d = _copy(tok_dir, tmp_path / "trunc")
    data = (d / "tokenizer.json").read_bytes()
    (d / "tokenizer.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="tokenizer.json: cannot be loaded"):
        Tokenizer(d)


@pytest.mark.parametrize(
    ("file", "content", "pattern"),
    [
        ("tokenizer_config.json", "{not json", "tokenizer_config.json: cannot be read as JSON"),
        ("tokenizer_config.json", "[1, 2]", "expected a JSON object"),
        ("tokenizer_config.json", json.dumps({"eos_token": "<nope>"}), "eos_token '<nope>' is not in the vocabulary"),
        ("tokenizer_config.json", json.dumps({"bos_token": 5}), "'bos_token' must be a string"),
        (
            "tokenizer_config.json",
            json.dumps({"bos_token": "<x>", "add_bos_token": True}),
            "bos_token '<x>' is not in the vocabulary",
        ),
        ("tokenizer_config.json", json.dumps({"add_bos_token": True}), "'add_bos_token' is true but no 'bos_token'"),
        ("tokenizer_config.json", json.dumps({"chat_template": 3}), "'chat_template' must be a string"),
        ("generation_config.json", json.dumps({"eos_token_id": "2"}), "generation_config.json: 'eos_token_id'"),
        ("config.json", "{", "config.json: cannot be read as JSON"),
    ],
)
def test_bad_config_files(tok_dir: Path, tmp_path: Path, file: str, content: str, pattern: str) -> None:
    d = _copy(tok_dir, tmp_path / "bad")
    (d / file).write_text(content)
    with pytest.raises(ModelFormatError, match=pattern):
        Tokenizer(d)


# --- streaming decode --------------------------------------------------------------------------


def _stream(decoder: StreamDecoder, ids: list[int]) -> list[str]:
    return [decoder.add(i) for i in ids] + [decoder.flush()]


def test_stream_splits_multibyte_chars_safely(tok: Tokenizer) -> None:
    text = "Emoji 🙂🚀 and 語 in a café, then 東京."
    ids = tok.encode(text)
    # Precondition: some character really is split over several tokens, else the test proves nothing.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = _stream(tok.stream_decoder(), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # Held back while incomplete: at least one step emitted nothing.
    assert "" in deltas[:-1]


def test_stream_keeps_spaces(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert "".join(_stream(tok.stream_decoder(), ids)) == tok.decode(ids), text
    ids = tok.encode("The model reads the weights")
    deltas = [d for d in _stream(tok.stream_decoder(), ids) if d]
    assert deltas[1].startswith(" ")


def test_stream_random_ids_concat_equals_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(1)
    for skip in (True, False):
        for _ in range(30):
            ids = [rng.randrange(tok.vocab_size + 8) for _ in range(rng.randrange(1, 40))]
            dec = tok.stream_decoder(skip_special_tokens=skip)
            assert "".join(_stream(dec, ids)) == tok.decode(ids, skip_special_tokens=skip)


def test_stream_add_many_and_context(tok: Tokenizer) -> None:
    prompt = tok.encode("Hello 日本")
    gen = tok.encode(" café 🙂 done")
    dec = tok.stream_decoder(context_ids=prompt)
    out = dec.add_many(gen[:3]) + dec.add_many(gen[3:]) + dec.flush()
    assert out == " café 🙂 done"


def test_stream_flush_emits_incomplete_tail(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🙂")
    dec = tok.stream_decoder()
    text = "".join(dec.add(i) for i in ids[:-1])
    assert "\ufffd" not in text
    assert text + dec.flush() == tok.decode(ids[:-1])


def test_stream_uses_context_for_sentencepiece_spaces() -> None:
    # Metaspace decoders drop the leading space of the first token; the prompt tail as context restores it.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")

    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    assert decode([2]) == "world"
    with_ctx = StreamDecoder(decode, context_ids=[1])
    assert with_ctx.add(2) + with_ctx.add(3) + with_ctx.flush() == " world!"
    no_ctx = StreamDecoder(decode)
    assert no_ctx.add(1) + no_ctx.add(2) + no_ctx.flush() == "Hello world"
