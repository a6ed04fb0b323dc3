"""Ollama's request fields as moed's: ``options`` -> SamplingParams, ``think`` -> template variables, ``format`` ->
a Grammar, ``keep_alive`` -> seconds, ``num_ctx`` -> the context an on-demand load gets.

Defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9), under the model's own parameters from its Ollama
manifest, under the request's ``options``. Options that change sampling in a way moed cannot honour are a 400
naming them; options about hardware and loading that moed decides itself have no effect (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moed.api.http.error_status import ParamError
from moed.engine.model_manager import LoadedEntry
from moed.engine.model_pool import UNSET, parse_keep_alive
from moed.engine.sampling import SamplingParams
from moed.errors import InvalidRequestError
from moed.text.grammar import ANY_JSON_OBJECT, Grammar

OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# options moed cannot honour unless they hold their "off" value
REFUSED = {"mirostat": (0,), "typical_p": (1.0,), "tfs_z": (1.0,)}
# options about hardware and loading: moed measures and decides these itself (docs/api.md)
NO_EFFECT = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap",
             "use_mlock", "embedding_only", "num_thread", "num_keep", "penalize_newline", "repeat_last_n",
             "mirostat_tau", "mirostat_eta")
KNOWN = {"temperature", "top_k", "top_p", "min_p", "seed", "num_predict", "num_ctx", "stop", "repeat_penalty",
         "presence_penalty", "frequency_penalty", *REFUSED, *NO_EFFECT}


def merged_options(entry: LoadedEntry | None, options: Any) -> dict[str, Any]:
    """Ollama's defaults, then the model's manifest parameters, then the request's ``options``."""
    if options is not None and not isinstance(options, Mapping):
        options = options.model_dump(exclude_none=True) if hasattr(options, "model_dump") else None
        if options is None:
            raise ParamError("options must be an object such as {\"temperature\": 0.2}", "options")
    merged = dict(OLLAMA_DEFAULTS)
    if entry is not None and entry.found is not None:
        merged.update({k: v for k, v in entry.found.params.items() if k in KNOWN})
    merged.update({k: v for k, v in (options or {}).items() if v is not None})
    return merged


def _number(options: dict, key: str, kind=float):
    value = options.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and int(value) != value):
        raise ParamError(f"options.{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}",
                         f"options.{key}")
    return kind(value)


def sampling_params(options: dict, *, room: int, grammar: Grammar | None) -> SamplingParams:
    """The request's sampling; ``room``: the tokens the context has left (num_predict -1 / -2 / unset: all)."""
    unknown = sorted(k for k in options if k not in KNOWN)
    if unknown:
        raise ParamError(f"options.{unknown[0]} is not an Ollama option moed knows; leave it out", f"options.{unknown[0]}")
    for key, off in REFUSED.items():
        if key in options and options[key] not in off:
            raise ParamError(f"options.{key} is not supported by moed's sampler; leave it out (or set it to {off[0]})",
                             f"options.{key}")
    predict = _number(options, "num_predict", int)
    max_tokens = room if predict is None or predict < 0 else min(max(predict, 1), room)
    stop = options.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ParamError("options.stop must be a list of strings", "options.stop")
    try:
        return SamplingParams(
            temperature=_number(options, "temperature") or 0.0, top_k=_number(options, "top_k", int) or 0,
            top_p=_number(options, "top_p") or 1.0, min_p=_number(options, "min_p") or 0.0,
            repetition_penalty=_number(options, "repeat_penalty") or 1.0,
            presence_penalty=_number(options, "presence_penalty") or 0.0,
            frequency_penalty=_number(options, "frequency_penalty") or 0.0,
            seed=_number(options, "seed", int), max_tokens=max_tokens, stop=tuple(stop), grammar=grammar)
    except InvalidRequestError as exc:
        raise ParamError(f"options: {exc}", "options") from None


def format_grammar(fmt: Any) -> Grammar | None:
    """Ollama's ``format``: "json" (any JSON object) or a JSON schema."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return Grammar.json_schema(ANY_JSON_OBJECT)
    if isinstance(fmt, dict):
        try:
            return Grammar.json_schema(fmt)
        except InvalidRequestError as exc:
            raise ParamError(f"format: {exc}", "format") from None
    raise ParamError(f"format must be \"json\" or a JSON schema object, got {fmt!r}", "format")


def think_variables(think: Any) -> dict[str, Any]:
    """Ollama's ``think``: true / false (the template's ``enable_thinking``) or "low" / "medium" / "high" (gpt-oss's
    ``reasoning_effort``, thinking on)."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think in ("low", "medium", "high"):
        return {"enable_thinking": True, "reasoning_effort": think}
    raise ParamError(f"think must be true, false, \"low\", \"medium\" or \"high\", got {think!r}", "think")


def keep_alive_of(value: Any):
    """Seconds (None: forever) or UNSET when the request gives none."""
    if value is None:
        return UNSET
    try:
        return parse_keep_alive(value)
    except InvalidRequestError as exc:
        raise ParamError(str(exc), "keep_alive") from None


def num_ctx_of(options: Any) -> int | None:
    """``options.num_ctx``: the context a model this request loads on demand gets (None: the daemon's choice)."""
    ctx = options.get("num_ctx") if isinstance(options, Mapping) else getattr(options, "num_ctx", None)
    if ctx is None:
        return None
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 2:
        raise ParamError(f"options.num_ctx must be an integer of at least 2 tokens, got {ctx!r}", "options.num_ctx")
    return ctx
