"""The grammar of a forced tool call (``tool_choice`` "required", a named tool, Anthropic's "any" / "tool"), in the
tool-call syntax the model writes, so that the family's parser reads the calls as usual (issue #34).

Each call's arguments are a JSON value of the tool's parameter schema (an embedded ``%json`` grammar), its name
one of the offered tools'. Formats with JSON arguments inside text wrappers are covered:

* ``generic`` (moed's format for templates without tool syntax) and ``hermes`` / ``qwen3`` (Qwen's Hermes
  JSON)::

      <tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call>

  Qwen3's ``<think>...</think>`` may come first (or the answer starts inside it when the prompt opened it).

Other syntaxes (Qwen3-Coder's XML, gpt-oss's harmony, DeepSeek's tokens, DSML, GLM, Mistral) get no grammar
yet: ``tool_call_grammar`` returns None and the request asks for a call without forcing it (docs/agents.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from moed.text.grammar import JSON_LAYOUT, Grammar

JSON_WRAPPED = ("generic", "hermes", "qwen3")
REASONING = {"qwen3": ("<think>", "</think>")}


def _call_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One call's JSON: {"name": one of the tools, "arguments": that tool's parameters}."""
    options = []
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters") or function.get("input_schema") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


def tool_call_grammar(tool_format: str, tools: Sequence[dict[str, Any]], *, parallel: bool = True,
                      reasoning: str = "optional", xml_calls: bool = False) -> Grammar | None:
    """The grammar of an answer that is one or more calls (one when not ``parallel``) of ``tools`` in
    ``tool_format``, or None where moed has no grammar for that syntax (``xml_calls``: Qwen3-Coder's XML body).
    ``reasoning``: "optional" (a reasoning block may come first), "open" (the prompt opened one: the answer
    starts inside it) or "none" (the prompt closed it, as Qwen3's template does without thinking)."""
    if not tools or tool_format not in JSON_WRAPPED or xml_calls:
        return None
    call = '"<tool_call>\\n" %json ' + json.dumps(_call_schema(tools)) + ' "\\n</tool_call>"'
    calls = "call" if not parallel else 'call ("\\n" call)*'
    lines = ["%llguidance {}", f"call: {call}", f"calls: {calls}"]
    tags = REASONING.get(tool_format)
    if tags is None or reasoning == "none":
        lines.append("start: calls")
    else:
        opened, closed = (json.dumps(t) for t in tags)
        lines.append(f"think_rest[lazy]: /(.|\\n)*/ {closed}")
        lines.append("GAP: /[ \\n]*/")
        lines.append("start: think_rest GAP calls" if reasoning == "open" else f"start: ({opened} think_rest GAP)? calls")
    return Grammar("lark", "\n".join(lines) + "\n")


__all__ = ["JSON_WRAPPED", "tool_call_grammar"]
