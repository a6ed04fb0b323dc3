"""A Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries no tokenizer.json: llama.cpp's converter stores the vocabulary (``tokenizer.ggml.tokens``
in byte-level spelling, ``token_type``), the BPE ``merges``, the special token ids, the chat
template and ``tokenizer.ggml.pre``, a name for the regex that splits text before BPE. That is all
a byte-level BPE tokenizer is, so the same tokenizer is rebuilt here in the ``tokenizers`` JSON
format, with the split regexes llama.cpp uses for each ``pre`` (src/llama-vocab.cpp), written as
the Hugging Face tokenizer.json of that model family writes them.

SentencePiece BPE vocabularies (``tokenizer.ggml.model = "llama"``: Mixtral, Mistral, Llama 2) carry
tokens with a score each and ``<0xXX>`` byte tokens instead of merges. llama.cpp tokenises them by
merging the adjacent pair whose merged token scores highest; the same tokenizer in the tokenizers
library is BPE with byte fallback and merges ranked by the merged token's score (``_spm_merges``),
after a normalizer that writes spaces as "▁" and puts one in front of each piece of text
(``add_space_prefix``, llama.cpp's default, also after a special token, as llama.cpp does). Other
tokenizer models (Unigram "t5", WordPiece "bert" ...) are refused.

Gemma-4's vocabulary (``tokenizer.ggml.model = "gemma4"``) is a BPE over raw UTF-8 with merges and byte
fallback, spaces written as "▁" by a normalizer and no space prefix: rebuilt as transformers' GemmaTokenizer
builds it (normalizer, the no-op split on spaces, decoder), the merges and tokens from the file.

Input is the plain-Python metadata dict (``moed.weights.gguf_file.GgufFile.metadata``); nothing
here reads files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moed.errors import ModelFormatError, UnsupportedModelError, quoted
from moed.text.tiktoken_vocab import KIMI_PATTERN, added_token

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# GPT-2's split, which ByteLevel(use_regex=True) applies itself
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# llama.cpp's fallback for files without a `pre` ("default")
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                   r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """How one ``tokenizer.ggml.pre`` value splits text before byte-level BPE."""

    splits: tuple[str, ...] = ()  # regexes applied in turn, each match and each gap its own piece
    individual_digits: bool = False  # every digit its own piece (SmolLM's Digits pre-tokenizer)
    gpt2_split: bool = False  # then GPT-2's own regex (ByteLevel use_regex)
    ignore_merges: bool = False  # a whole piece found in the vocabulary is one token (Llama 3)
    add_bos: bool = False  # llama.cpp's add_bos_token when the file does not say


_LLAMA3 = PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((_QWEN2_SPLIT,))
_GPT4O = PreTokenizer((_GPT4O_SPLIT,))
_GPT2 = PreTokenizer(gpt2_split=True)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "gpt-4o": _GPT4O, "llama4": _GPT4O,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "dbrx": _LLAMA3, "smaug-bpe": _LLAMA3,
    "smollm": PreTokenizer(individual_digits=True, gpt2_split=True),
    "gpt-2": _GPT2, "phi-2": _GPT2, "olmo": _GPT2, "mpt": _GPT2,
    "deepseek-v3": PreTokenizer(_DEEPSEEK_V3_SPLITS),
    "kimi-k2": PreTokenizer((KIMI_PATTERN,)),  # Kimi-K2's / Kimi-Linear's split (text/tiktoken_vocab.py)
    "default": PreTokenizer(_DEFAULT_SPLITS),
}

# Tokens llama.cpp ends generation on when the vocabulary has them (src/llama-vocab.cpp): a GGUF
# keeps no generation_config.json, whose eos list these stand in for.
_END_OF_GENERATION = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
)

_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def gguf_tokenizer_files(metadata: Mapping[str, Any], *, where: str) -> dict[str, str]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` (its eos list) as
    file contents, what a Hugging Face directory of the same model would hold."""
    tok_json = metadata.get("tokenizer.huggingface.json")
    if not isinstance(tok_json, str):  # some converters embed the original; else rebuild it
        tok_json = json.dumps(tokenizer_json(metadata, where=where), ensure_ascii=False)
    generation = {"eos_token_id": stop_token_ids(metadata, where=where)}
    bos = _token_id(metadata, "bos_token_id", where)
    if bos is not None:
        generation["bos_token_id"] = bos
    return {"tokenizer.json": tok_json,
            "tokenizer_config.json": json.dumps(tokenizer_config(metadata, where=where), ensure_ascii=False, indent=2),
            "generation_config.json": json.dumps(generation, indent=2)}


_SENTENCEPIECE = PreTokenizer(add_bos=True)  # llama.cpp adds BOS for SentencePiece vocabularies by default
_GEMMA4 = PreTokenizer(add_bos=True)  # llama.cpp's "gemma4" tokenizer model (module docstring)


def pre_tokenizer_of(metadata: Mapping[str, Any], *, where: str) -> PreTokenizer:
    model = metadata.get("tokenizer.ggml.model")
    if model == "llama":
        return _SENTENCEPIECE
    if model == "gemma4":
        return _GEMMA4
    if model != "gpt2":
        kind = {"t5": "Unigram", "bert": "WordPiece"}.get(model, "")
        raise UnsupportedModelError(
            f"{where}: tokenizer.ggml.model {quoted(model)}{f' ({kind})' if kind else ''} is not supported; moed "
            "rebuilds byte-level BPE ('gpt2'), SentencePiece BPE ('llama') and Gemma-4's ('gemma4') tokenizers from "
            "GGUF metadata; use "
            "the model's Hugging Face directory instead")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"{where}: tokenizer.ggml.pre {quoted(pre)} is not a pre-tokenizer moed knows ({', '.join(PRE_TOKENIZERS)}); "
            "it decides how text is split before BPE, so a guess would tokenise wrongly; use the model's Hugging "
            "Face directory instead")
    return PRE_TOKENIZERS[pre]


def tokenizer_json(metadata: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """The tokenizers-library JSON of the byte-level BPE tokenizer the metadata describes."""
    pre = pre_tokenizer_of(metadata, where=where)
    if pre is _SENTENCEPIECE:
        return _spm_tokenizer_json(metadata, where)
    if pre is _GEMMA4:
        return _gemma4_tokenizer_json(metadata, where)
    tokens, types = _tokens(metadata, where)
    pairs = _merges(metadata, where)
    vocab: dict[str, int] = {}
    added = []
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind == TOKEN_UNUSED:  # slots ("[PAD123]") that pad the embedding; llama.cpp decodes them to nothing
            continue
        vocab.setdefault(token, token_id)  # added tokens too: the tokenizers library keeps their ids only then
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            # matched whole in the text before any splitting, as llama.cpp does
            added.append(added_token(token_id, token, kind == TOKEN_CONTROL))
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer_json(pre),
        "post_processor": _post_processor_json(metadata, tokens, pre, where),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre.ignore_merges, "vocab": vocab, "merges": pairs},
    }


def _merges(metadata: Mapping[str, Any], where: str) -> list[list[str]]:
    pairs = []
    for merge in _string_list(metadata, "tokenizer.ggml.merges", where):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ModelFormatError(f"{where}: tokenizer.ggml.merges holds {quoted(merge)}, not two tokens separated "
                                   "by one space; the file is corrupt, download it again")
        pairs.append(parts)
    return pairs


def _gemma4_tokenizer_json(metadata: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The tokenizers-library JSON of Gemma-4's vocabulary (module docstring)."""
    tokens, types = _tokens(metadata, where)
    unk = _token_id(metadata, "unknown_token_id", where, len(tokens))
    vocab: dict[str, int] = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind != TOKEN_UNUSED:
            vocab.setdefault(token, token_id)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
        "post_processor": _post_processor_json(metadata, tokens, _GEMMA4, where),
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                                                      {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": None if unk is None else tokens[unk],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": _merges(metadata, where)},
    }


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """Control and user-defined tokens, matched whole in the text before anything else (as llama.cpp does)."""
    return [added_token(i, token, kind == TOKEN_CONTROL)
            for i, (token, kind) in enumerate(zip(tokens, types)) if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[list[str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging: every split of a normal token into
    two normal tokens is a merge, ranked by the merged token's score (highest first), ties by the
    halves' ids."""
    ids = {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind == TOKEN_NORMAL}
    merges = []
    for merged, i in ids.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in ids and right in ids:
                merges.append((-scores[i], ids[left], ids[right], left, right))
    merges.sort()
    return [[left, right] for *_, left, right in merges]


def _spm_tokenizer_json(metadata: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The tokenizers-library JSON of a SentencePiece BPE vocabulary (module docstring)."""
    tokens, types = _tokens(metadata, where)
    scores = metadata.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in scores):
        raise ModelFormatError(f"{where}: tokenizer.ggml.scores is not one number per token ({len(tokens)} tokens); "
                               "a SentencePiece vocabulary needs them; the file is corrupt, download it again")
    unk = _token_id(metadata, "unknown_token_id", where, len(tokens))
    space_prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", True, where)
    vocab: dict[str, int] = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind != TOKEN_UNUSED:
            vocab.setdefault(token, token_id)
    normalizers: list[dict[str, Any]] = [{"type": "Prepend", "prepend": "▁"}] if space_prefix else []
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})
    decoders: list[dict[str, Any]] = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                                      {"type": "ByteFallback"}, {"type": "Fuse"}]
    if space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": _post_processor_json(metadata, tokens, _SENTENCEPIECE, where),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": None if unk is None else tokens[unk],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                  "merges": _spm_merges(tokens, types, scores)},
    }


def tokenizer_config(metadata: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by content, add_bos/eos, the chat template(s)."""
    pre = pre_tokenizer_of(metadata, where=where)
    tokens, _ = _tokens(metadata, where)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _SPECIAL_IDS.items():
        token_id = _token_id(metadata, key, where, len(tokens))
        config[name] = None if token_id is None else tokens[token_id]
    config["add_bos_token"] = _flag(metadata, "tokenizer.ggml.add_bos_token", pre.add_bos, where)
    config["add_eos_token"] = _flag(metadata, "tokenizer.ggml.add_eos_token", False, where)
    config["clean_up_tokenization_spaces"] = False
    arch = metadata.get("general.architecture")
    context = metadata.get(f"{arch}.context_length")
    if isinstance(context, int) and context > 0:
        config["model_max_length"] = context
    template = _chat_templates(metadata, where)
    if template is not None:
        config["chat_template"] = template
    return config


def stop_token_ids(metadata: Mapping[str, Any], *, where: str) -> list[int]:
    """Ids that end generation: eos (first), eot, eom, and the end-of-turn tokens llama.cpp adds by text."""
    tokens, _ = _tokens(metadata, where)
    ids = [i for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (i := _token_id(metadata, key, where, len(tokens))) is not None]
    by_text = {token: i for i, token in enumerate(tokens) if token in _END_OF_GENERATION}
    if "<|return|>" in by_text and "<|call|>" in by_text:
        by_text.pop("<|end|>", None)  # harmony (gpt-oss): <|end|> closes a message, not the answer
    ids += sorted(by_text.values())
    return list(dict.fromkeys(ids))


def _pre_tokenizer_json(pre: PreTokenizer) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
                                    "invert": False} for regex in pre.splits]
    if pre.individual_digits:
        steps.append({"type": "Digits", "individual_digits": True})
    steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": pre.gpt2_split})
    return steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps}


def _post_processor_json(metadata: Mapping[str, Any], tokens: list[str], pre: PreTokenizer,
                         where: str) -> dict[str, Any] | None:
    """BOS / EOS added around every encoding when the file asks for them (llama.cpp's add_bos/add_eos)."""
    ends = []
    for side, key, flag_key, default in (("bos", "bos_token_id", "tokenizer.ggml.add_bos_token", pre.add_bos),
                                         ("eos", "eos_token_id", "tokenizer.ggml.add_eos_token", False)):
        token_id = _token_id(metadata, key, where, len(tokens))
        if _flag(metadata, flag_key, default, where):
            if token_id is None:
                raise ModelFormatError(f"{where}: {flag_key} is true but tokenizer.ggml.{key} is missing; the "
                                       "file's tokenizer metadata is incomplete")
            ends.append((side, tokens[token_id], token_id))
    if not ends:
        return None
    bos = [e for e in ends if e[0] == "bos"]
    eos = [e for e in ends if e[0] == "eos"]

    def template(*seqs: str) -> list[dict]:
        out: list[dict] = []
        for i, seq in enumerate(seqs):
            out += [{"SpecialToken": {"id": tok, "type_id": i}} for _, tok, _ in bos]
            out.append({"Sequence": {"id": seq, "type_id": i}})
            out += [{"SpecialToken": {"id": tok, "type_id": i}} for _, tok, _ in eos]
        return out

    return {"type": "TemplateProcessing", "single": template("A"), "pair": template("A", "B"),
            "special_tokens": {tok: {"id": tok, "ids": [i], "tokens": [tok]} for _, tok, i in ends}}


def _tokens(metadata: Mapping[str, Any], where: str) -> tuple[list[str], list[int]]:
    tokens = _string_list(metadata, "tokenizer.ggml.tokens", where)
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        types = [TOKEN_NORMAL] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
        raise ModelFormatError(f"{where}: tokenizer.ggml.token_type is not one integer per token "
                               f"({len(tokens)} tokens); the file is corrupt, download it again")
    return tokens, types


def _string_list(metadata: Mapping[str, Any], key: str, where: str) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ModelFormatError(f"{where}: metadata {key} is missing or not a list of strings; the GGUF file has no "
                               "usable tokenizer (re-convert it with llama.cpp's convert_hf_to_gguf.py)")
    return value


def _token_id(metadata: Mapping[str, Any], key: str, where: str, num_tokens: int | None = None) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (
            num_tokens is not None and value >= num_tokens):
        raise ModelFormatError(f"{where}: tokenizer.ggml.{key} = {quoted(value)} is not a token id "
                               f"(the vocabulary has {num_tokens} tokens); the file is corrupt")
    return value


def _flag(metadata: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise ModelFormatError(f"{where}: {key} should be true or false, got {quoted(value)}")
    return value


def _chat_templates(metadata: Mapping[str, Any], where: str) -> str | list[dict[str, str]] | None:
    """``tokenizer.chat_template``, plus named variants (``tokenizer.chat_template.tool_use`` ...)."""
    default = metadata.get("tokenizer.chat_template")
    names: Sequence[Any] = metadata.get("tokenizer.chat_templates") or []
    named = {}
    for name in names:
        template = metadata.get(f"tokenizer.chat_template.{name}")
        if isinstance(name, str) and isinstance(template, str):
            named[name] = template
    if default is not None and not isinstance(default, str):
        raise ModelFormatError(f"{where}: tokenizer.chat_template should be a string, got {type(default).__name__}")
    if not named:
        return default
    templates = ([{"name": "default", "template": default}] if default is not None else [])
    return templates + [{"name": n, "template": t} for n, t in named.items()]
