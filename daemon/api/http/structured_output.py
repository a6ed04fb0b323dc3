"""The three APIs' structured-output fields, and moed's grammar extension, as one ``Grammar`` (issue #34).

* OpenAI Chat Completions ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``; ``{"type": "text"}`` is no constraint.
  The SDK's ``client.chat.completions.parse(response_format=Model)`` sends the second form.
* OpenAI Responses ``text.format``: the same two, flattened (``{"type": "json_schema", "name", "schema"}``).
* Anthropic Messages ``output_config.format``: ``{"type": "json_schema", "schema"}`` (``client.messages.parse``).
* moed's extension on chat and completions, as llama-server names it: ``grammar`` (a GBNF string, or
  ``{"type": "gbnf" | "lark" | "regex", "grammar": text}``) and ``json_schema`` (a schema object).

Constraints are enforced whatever ``strict`` says (as vLLM does): a schema the grammar library cannot compile is
a 400 naming the field. At most one of these may be given.
"""

from __future__ import annotations

from typing import Any

from moed.api.http.error_status import ParamError
from moed.errors import InvalidRequestError
from moed.text.grammar import ANY_JSON_OBJECT, Grammar

GRAMMAR_TYPES = ("gbnf", "lark", "regex")


def _schema_grammar(schema: Any, field: str) -> Grammar:
    if schema is None:
        return Grammar.json_schema(ANY_JSON_OBJECT)
    if not isinstance(schema, dict):
        raise ParamError(f"{field} must be a JSON schema object, got {type(schema).__name__}", field)
    try:
        return Grammar.json_schema(schema)
    except InvalidRequestError as exc:
        raise ParamError(f"{field}: {exc}", field) from None


def _format_grammar(fmt: Any, field: str, *, nested: bool) -> Grammar | None:
    """One ``response_format`` (nested: its schema under ``json_schema``) or ``text.format`` (flat)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ParamError(f"{field} must be an object such as {{\"type\": \"json_object\"}}", field)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema(ANY_JSON_OBJECT)
    if kind == "json_schema":
        spec = fmt.get("json_schema") if nested else fmt
        where = f"{field}.json_schema" if nested else field
        if not isinstance(spec, dict):
            raise ParamError(f"{where} must be an object with the 'schema' to follow", where)
        return _schema_grammar(spec.get("schema"), f"{where}.schema")
    raise ParamError(f"{field}.type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'",
                     f"{field}.type")


def openai_chat_grammar(body: Any) -> Grammar | None:
    """Chat Completions: ``response_format`` or the extension (``extension_grammar``)."""
    found = [g for g in (_format_grammar(getattr(body, "response_format", None), "response_format", nested=True),
                         extension_grammar(body)) if g is not None]
    if len(found) > 1:
        raise ParamError("give one constraint: response_format, grammar or json_schema", "response_format")
    return found[0] if found else None


def responses_grammar(body: Any) -> Grammar | None:
    text = getattr(body, "text", None)
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ParamError("text must be an object such as {\"format\": {\"type\": \"text\"}}", "text")
    return _format_grammar(text.get("format"), "text.format", nested=False)


def anthropic_grammar(output_config: Any) -> Grammar | None:
    fmt = getattr(output_config, "format", None) if output_config is not None else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise ParamError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                         "output_config.format")
    if "schema" not in fmt:
        raise ParamError("output_config.format needs the 'schema' to follow", "output_config.format.schema")
    return _schema_grammar(fmt["schema"], "output_config.format.schema")


def extension_grammar(body: Any) -> Grammar | None:
    """llama-server's ``grammar`` (GBNF text) and ``json_schema``; ``grammar`` may also name its type."""
    grammar, schema = getattr(body, "grammar", None), getattr(body, "json_schema", None)
    if grammar is not None and schema is not None:
        raise ParamError("give either grammar or json_schema, not both", "grammar")
    if schema is not None:
        return _schema_grammar(schema, "json_schema")
    if grammar is None:
        return None
    if isinstance(grammar, str):
        kind, text = "gbnf", grammar
    elif isinstance(grammar, dict) and grammar.get("type") in GRAMMAR_TYPES and isinstance(grammar.get("grammar"), str):
        kind, text = grammar["type"], grammar["grammar"]
    else:
        raise ParamError("grammar must be a GBNF string or {\"type\": \"gbnf\" | \"lark\" | \"regex\", \"grammar\": "
                         "\"...\"}", "grammar")
    try:
        return Grammar(kind, text)
    except InvalidRequestError as exc:
        raise ParamError(f"grammar: {exc}", "grammar") from None


__all__ = ["anthropic_grammar", "extension_grammar", "openai_chat_grammar", "responses_grammar"]
