"""Tokenizer for a Hugging Face-style model dir: tokenizer.json + tokenizer_config.json (+ eos ids from configs)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from moed.errors import InvalidRequestError, ModelFormatError
from moed.text.chat_template import render_chat, require_chat_template
from moed.text.stream_decoder import StreamDecoder
from moed.text.tiktoken_vocab import TIKTOKEN_FILE, tiktoken_tokenizer_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

# transformers writes a huge sentinel (int(1e30)) when a tokenizer has no length limit.
_NO_MAX_LENGTH_ABOVE = 10**12


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelFormatError(
                f"{path}: file not found. A model directory needs {TOKENIZER_FILE} and {TOKENIZER_CONFIG_FILE} "
                f"from the model's Hugging Face repository; copy them into {path.parent}."
            )
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(
            f"{path}: cannot be read as JSON ({exc}); the file is corrupt or truncated, download it again."
        ) from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object at top level, got {type(data).__name__}.")
    return data


def _token_string(value: Any, key: str, path: Path | str) -> str | None:
    # tokenizer_config.json stores special tokens either as plain strings or as serialized AddedToken dicts.
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelFormatError(
        f"{path}: {key!r} must be a string or an object with a string 'content', got {value!r}."
    )


def _token_ids(value: Any, key: str, path: Path | str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelFormatError(
                f"{path}: {key!r} must be a non-negative integer or a list of them, got {value!r}."
            )
    return list(values)


def _chat_templates(value: Any, path: Path | str) -> dict[str, str]:
    # Either one template string, or a list of {"name", "template"} (named variants such as "tool_use").
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ModelFormatError(
        f"{path}: 'chat_template' must be a string or a list of {{'name': ..., 'template': ...}} objects."
    )


def _load_chat_templates(model_dir: Path, cfg: dict[str, Any], cfg_path: Path) -> tuple[dict[str, str], str]:
    """Named chat templates and the file the default one came from."""
    templates = _chat_templates(cfg.get("chat_template"), cfg_path)
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    if not jinja_path.is_file():
        return templates, TOKENIZER_CONFIG_FILE
    # Newer repos ship the template as its own file; transformers gives it priority over the config.
    try:
        templates["default"] = jinja_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{jinja_path}: cannot be read ({exc}); download it again.") from exc
    return templates, CHAT_TEMPLATE_FILE


def _parse_json_text(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{where}: not valid JSON ({exc}).") from exc
    if not isinstance(data, dict):
        raise ModelFormatError(f"{where}: expected a JSON object at top level, got {type(data).__name__}.")
    return data


def _eos_ids_of(data: dict[str, Any], path: Path | str) -> list[int]:
    ids = _token_ids(data.get("eos_token_id"), "eos_token_id", path)
    text_cfg = data.get("text_config")
    if isinstance(text_cfg, dict):  # multimodal configs nest the language model's ids
        ids += _token_ids(text_cfg.get("eos_token_id"), "text_config.eos_token_id", path)
    return ids


def _config_eos_ids(model_dir: Path) -> list[int]:
    """eos ids from generation_config.json and config.json (either may be absent)."""
    ids: list[int] = []
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        path = model_dir / name
        data = _read_json(path, required=False)
        if data is not None:
            ids += _eos_ids_of(data, path)
    return ids


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level table, reversed: the printable character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Tokenizer:
    """Text <-> token ids for one model, plus the special tokens and chat template that go with it."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tok_path = model_dir / TOKENIZER_FILE
        cfg_path = model_dir / TOKENIZER_CONFIG_FILE
        tiktoken_path = model_dir / TIKTOKEN_FILE
        if not tok_path.is_file() and tiktoken_path.is_file():
            # Moonshot's Kimi checkpoints: a tiktoken vocabulary and Python code instead (text/tiktoken_vocab.py)
            cfg = _read_json(cfg_path, required=True) or {}
            backend = tokenizers.Tokenizer.from_str(json.dumps(tiktoken_tokenizer_json(tiktoken_path, cfg)))
        else:
            if not tok_path.is_file():
                _read_json(tok_path, required=True)  # raises the "not found" error
            try:
                backend = tokenizers.Tokenizer.from_file(str(tok_path))
            except Exception as exc:  # the Rust side raises a bare Exception for every parse problem
                raise ModelFormatError(
                    f"{tok_path}: cannot be loaded by the tokenizers library ({exc}); "
                    "the file is corrupt, truncated or from an unsupported tokenizer format; download it again."
                ) from exc
            cfg = _read_json(cfg_path, required=True) or {}
        self.model_dir: Path | None = model_dir
        self._setup(backend, cfg, cfg_path, lambda: _load_chat_templates(model_dir, cfg, cfg_path),
                    lambda: _config_eos_ids(model_dir))

    @classmethod
    def from_files(cls, files: Mapping[str, str], *, where: str) -> Tokenizer:
        """A tokenizer from file contents instead of a directory: ``files`` maps names
        (``tokenizer.json``, ``tokenizer_config.json``, optionally ``generation_config.json``,
        ``config.json``, ``chat_template.jinja``) to their text, e.g. what
        ``moed.text.gguf_vocab.gguf_tokenizer_files`` builds from a GGUF file; ``where`` (that
        file's path) is named in errors."""
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            if name not in files:
                raise ModelFormatError(f"{where}: no {name} given to build the tokenizer from.")
        try:
            backend = tokenizers.Tokenizer.from_str(files[TOKENIZER_FILE])
        except Exception as exc:  # the Rust side raises a bare Exception for every parse problem
            raise ModelFormatError(f"{where}: its {TOKENIZER_FILE} cannot be loaded by the tokenizers library "
                                   f"({exc}); the tokenizer metadata is corrupt or unsupported.") from exc
        label = f"{where} ({TOKENIZER_CONFIG_FILE})"
        cfg = _parse_json_text(files[TOKENIZER_CONFIG_FILE], label)

        def templates() -> tuple[dict[str, str], str]:
            named = _chat_templates(cfg.get("chat_template"), label)
            if CHAT_TEMPLATE_FILE in files:
                named["default"] = files[CHAT_TEMPLATE_FILE]
                return named, CHAT_TEMPLATE_FILE
            return named, TOKENIZER_CONFIG_FILE

        def eos_ids() -> list[int]:
            ids: list[int] = []
            for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
                if name in files:
                    ids += _eos_ids_of(_parse_json_text(files[name], f"{where} ({name})"), f"{where} ({name})")
            return ids

        tokenizer = cls.__new__(cls)
        tokenizer.model_dir = None
        tokenizer._setup(backend, cfg, label, templates, eos_ids)
        return tokenizer

    def _setup(self, backend: tokenizers.Tokenizer, cfg: dict[str, Any], cfg_path: Path | str,
               load_templates: Callable[[], tuple[dict[str, str], str]],
               load_config_eos_ids: Callable[[], list[int]]) -> None:
        """Everything both constructors share; the two loaders run where the checks reach them
        (templates, then the configs' eos ids), so errors come in the same order for both."""
        # Truncation/padding stored in tokenizer.json would silently cut prompts; length checks happen elsewhere.
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend

        self.bos_token = _token_string(cfg.get("bos_token"), "bos_token", cfg_path)
        self.eos_token = _token_string(cfg.get("eos_token"), "eos_token", cfg_path)
        self.pad_token = _token_string(cfg.get("pad_token"), "pad_token", cfg_path)
        self.unk_token = _token_string(cfg.get("unk_token"), "unk_token", cfg_path)
        # Only tokens moed relies on must exist: eos always (it ends generation), bos when it is prepended.
        self.eos_token_id = self._required_id(self.eos_token, "eos_token", cfg_path)
        add_bos = cfg.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise ModelFormatError(f"{cfg_path}: 'add_bos_token' must be true or false, got {add_bos!r}.")
        if add_bos and self.bos_token is None:
            raise ModelFormatError(f"{cfg_path}: 'add_bos_token' is true but no 'bos_token' is set.")
        self.add_bos_token: bool = add_bos
        self.bos_token_id = (
            self._required_id(self.bos_token, "bos_token", cfg_path)
            if add_bos
            else self._optional_id(self.bos_token)
        )
        self.pad_token_id = self._optional_id(self.pad_token)

        max_len = cfg.get("model_max_length")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, (int, float))):
            raise ModelFormatError(f"{cfg_path}: 'model_max_length' must be a number, got {max_len!r}.")
        self.model_max_length: int | None = (
            int(max_len) if max_len is not None and 0 < max_len < _NO_MAX_LENGTH_ABOVE else None
        )

        templates, self.chat_template_source = load_templates()
        self.chat_templates: dict[str, str] = templates
        self.chat_template: str | None = templates.get("default")

        # A model may stop on several tokens (e.g. Llama 3: <|end_of_text|>, <|eot_id|>); union every source.
        eos_ids = ([] if self.eos_token_id is None else [self.eos_token_id]) + load_config_eos_ids()
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        vocab = backend.get_vocab(with_added_tokens=True)
        # max id + 1, not len(): ids of added tokens may leave gaps.
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0

    def _optional_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _required_id(self, token: str | None, key: str, path: Path | str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ModelFormatError(
                f"{path}: {key} {token!r} is not in the vocabulary of {TOKENIZER_FILE}; "
                "the two files come from different models, download both again."
            )
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (max id + 1, added tokens included)."""
        return self._vocab_size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for text. Encode a rendered chat prompt with add_special_tokens=False (it has its own BOS)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(text).__name__}.")
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # add_bos_token=true asks for a BOS; tokenizer.json's post-processor usually adds it already, so never
        # prepend a second one (a doubled BOS measurably degrades Llama-family outputs).
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]  # checked non-None in __init__
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ids; ids the tokenizer does not know (e.g. padded embedding rows) decode to nothing."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a UTF-8 character, which
        ``decode`` shows as U+FFFD): byte-level vocabularies through GPT-2's byte <-> character table, ``<0xNN>``
        byte-fallback pieces as their byte, anything else as its decoded text."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self.special_token_ids:
            if isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel):
                table = _unicode_to_byte()
                if all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def stream_decoder(self, context_ids: Iterable[int] = (), skip_special_tokens: bool = True) -> StreamDecoder:
        """An incremental decoder for generated ids; context_ids (the prompt tail) fixes leading spaces."""
        return StreamDecoder(self.decode, context_ids=context_ids, skip_special_tokens=skip_special_tokens)

    def template_variables(self) -> dict[str, str]:
        """The special-token variables transformers exposes to chat templates."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
                 "unk_token": self.unk_token}
        return {k: v for k, v in named.items() if v is not None}

    def adopt_chat_template(self, template: str, source: str) -> None:
        """Use ``template`` as the default chat template (a tokenizer that came without one)."""
        self.chat_templates = {**self.chat_templates, "default": template}
        self.chat_template, self.chat_template_source = template, source

    @property
    def tool_chat_template(self) -> str | None:
        """The template that renders a request with tools: the "tool_use" one when the model has it."""
        return self.chat_templates.get("tool_use") or self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render messages with the model's chat template (the "tool_use" variant when tools are given)."""
        template = self.chat_templates.get("tool_use") if tools else None
        template = require_chat_template(template or self.chat_template)
        variables: Mapping[str, Any] = {**self.template_variables(), **extra}
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_source=self.chat_template_source,
            **variables,
        )
