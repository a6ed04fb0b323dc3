"""The grammar of a forced tool call (``tool_choice`` "required", a named tool, Anthropic's "any" / "tool"), in the
tool-call syntax the model writes, so that the family's parser reads the calls as usual (issue #34).

Each call names one of the offered tools and its arguments follow that tool's parameter schema (embedded
``%json`` grammars; string parameters of the XML-like syntaxes as raw text up to their closing tag):

* ``generic`` (moed's format for templates without tool syntax) and ``hermes`` / ``qwen3`` (Qwen's Hermes
  JSON)::

      <tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call>

* ``qwen3`` with Qwen3-Coder's XML body (Qwen3-Coder, Qwen3.5 / 3.6 templates)::

      <tool_call>\\n<function=N>\\n<parameter=K>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>

* ``glm`` (GLM-4.5 .. GLM-5; GLM-4.5's newlines allowed)::

      <tool_call>N<arg_key>K</arg_key><arg_value>value</arg_value></tool_call>

* ``harmony`` (gpt-oss), one call a turn, an analysis message first if the model writes one::

      <|channel|>commentary to=functions.N <|constrain|>json<|message|>{...}<|call|>

* ``dsml`` (DeepSeek-V3.2 ``function_calls``, V4 ``tool_calls``)::

      <｜DSML｜tool_calls>\\n<｜DSML｜invoke name="N">\\n<｜DSML｜parameter name="K" string="true|false">value</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n</｜DSML｜tool_calls>

* ``deepseek`` (DeepSeek-V3 / R1; V3.1's form where its template writes the name before the separator)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

* ``mistral`` (Mixtral's v3 tokenizer): ``[TOOL_CALLS][{"name": "N", "arguments": {...}}, ...]``

* ``minimax`` (MiniMax-M2 / M2.5)::

      <minimax:tool_call>\n<invoke name="N">\n<parameter name="K">value</parameter>\n</invoke>\n</minimax:tool_call>

* ``kimi`` (Kimi-K2, Kimi-Linear)::

      <|tool_calls_section_begin|><|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>

* ``gemma4`` (Gemma-4; the arguments as JSON of the tool's schema: Gemma's parser reads quoted keys and strings as
  well as its own ``<|"|>`` ones)::

      <|tool_call>call:N{...}<tool_call|>

* ``llama4`` (Llama-4's template asks for JSON calls; several are separated by ``; ``)::

      {"name": "N", "parameters": {...}}

A ``<think>...</think>`` block may come first (or the answer starts inside it when the prompt opened it).
Parameters come in the schema's order (required ones always, the others optionally). Markers the tokenizer has
as special tokens (harmony's, DeepSeek's, ``[TOOL_CALLS]``) are referenced by id. A syntax without a grammar
(``plain``) gets None from ``tool_call_grammar`` and the request asks for a call without forcing it
(docs/agents.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from moed.text.grammar import JSON_LAYOUT, Grammar

JSON_WRAPPED = ("generic", "hermes", "qwen3")
GRAMMAR_FORMATS = JSON_WRAPPED + ("dsml", "glm", "harmony", "deepseek", "mistral", "minimax", "llama4", "kimi",
                                  "gemma4")
REASONING = {"qwen3": ("<think>", "</think>"), "glm": ("<think>", "</think>"), "deepseek": ("<think>", "</think>"),
             "minimax": ("<think>", "</think>"), "kimi": ("<think>", "</think>"),
             "gemma4": ("<|channel>thought", "<channel|>")}
DSML = "｜DSML｜"  # the fullwidth bars are part of DeepSeek's markup tokens


def _call_schema(tools: Sequence[dict[str, Any]], key: str = "arguments") -> dict[str, Any]:
    """One call's JSON: {"name": one of the tools, ``key``: that tool's parameters}."""
    options = []
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters") or function.get("input_schema") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]}, key: parameters},
                        "required": ["name", key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}


def _value(schema: Any, rule: str, close: str) -> list[str]:
    """Rules for one raw parameter value followed by ``close``: a string as free text up to ``close`` (a lazy
    rule: the first ``close`` ends it; minLength / maxLength bound it, a pattern is not applied), anything else
    as JSON of its schema."""
    if _raw_choices(schema):  # an enum of strings: one of them, written raw
        return [f"{rule}: ({' | '.join(json.dumps(v) for v in schema['enum'])}) {json.dumps(close)}"]
    if _is_string(schema):
        low, high = schema.get("minLength"), schema.get("maxLength")
        repeat = "*" if low is None and high is None else f"{{{int(low or 0)},{'' if high is None else int(high)}}}"
        return [f"{rule}[lazy]: /(.|\\n){repeat}/ {json.dumps(close)}"]
    return [f"{rule}: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})} {json.dumps(close)}"]


def _raw_choices(schema: dict) -> bool:
    enum = schema.get("enum")
    return isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)


def _is_string(schema: dict) -> bool:
    """A parameter written as raw text: a string, or an enum of strings."""
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return _raw_choices(schema) or (kind == "string" and "enum" not in schema)


def _parameters(parameters: Any) -> list[tuple[str, Any, bool]]:
    """(name, schema, required) of each parameter, in the schema's order."""
    props = (parameters or {}).get("properties") or {}
    required = set((parameters or {}).get("required") or ())
    return [(name, schema if isinstance(schema, dict) else {}, name in required) for name, schema in props.items()]


def _tagged_calls(tools: Sequence[dict[str, Any]], call_open, param_open, param_close: str, after_value: str,
                  call_close: str) -> tuple[list[str], list[str]]:
    """Rules of calls whose parameters are tagged one by one (the XML-like syntaxes): per tool ``f{t}`` =
    ``call_open(name)`` + its parameters in the schema's order (required always, others optionally), each
    ``param_open(key, schema)`` + value (up to ``param_close``) + ``after_value``, then ``call_close``. The
    callables and strings are Lark fragments. Returns (rules, the tools' rule names)."""
    rules, options = [], []
    for t, tool in enumerate(tools):
        function = tool.get("function", tool)
        parts = []
        for p, (name, schema, required) in enumerate(_parameters(function.get("parameters")
                                                                 or function.get("input_schema"))):
            rules.append(f"p{t}_{p}: {param_open(name, schema)} v{t}_{p} {after_value}".rstrip())
            rules += _value(schema, f"v{t}_{p}", param_close)
            parts.append(f"p{t}_{p}" + ("" if required else "?"))
        rules.append(f"f{t}: {call_open(function['name'])} {' '.join(parts)} {call_close}")
        options.append(f"f{t}")
    return rules, options


def _xml_calls(tools: Sequence[dict[str, Any]]) -> tuple[list[str], str]:
    """Qwen3-Coder's ``<tool_call>\n<function=N>\n<parameter=K>\nvalue\n</parameter>\n</function>\n</tool_call>``."""
    rules, options = _tagged_calls(
        tools, lambda name: json.dumps(f"<tool_call>\n<function={name}>\n"),
        lambda key, schema: json.dumps(f"<parameter={key}>\n"), "\n</parameter>\n", "",
        json.dumps("</function>\n</tool_call>"))
    return rules, " | ".join(options)


def _dsml_calls(tools: Sequence[dict[str, Any]], prefix: str = DSML) -> tuple[list[str], str]:
    """DeepSeek's DSML invokes, each parameter with ``string="true"`` and its raw text, or ``string="false"`` and
    JSON; with ``prefix`` "", MiniMax-M2's invokes (no ``string`` attribute: raw strings, other values JSON). The
    block around them: ``tool_call_grammar``."""
    def param_open(key: str, schema: dict) -> str:
        kind = "" if not prefix else f' string="{"true" if _is_string(schema) else "false"}"'
        return json.dumps(f'<{prefix}parameter name="{key}"{kind}>')

    rules, options = _tagged_calls(
        tools, lambda name: json.dumps(f'<{prefix}invoke name="{name}">\n'), param_open,
        f"</{prefix}parameter>\n", "", json.dumps(f"</{prefix}invoke>\n"))
    rules.append(f"invokes: ({' | '.join(options)})")
    return rules, "invokes"


def _glm_calls(tools: Sequence[dict[str, Any]]) -> tuple[list[str], str]:
    """GLM's ``<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` (GLM-4.7 / GLM-5), with the
    newlines GLM-4.5 puts after the name and between the pairs allowed."""
    rules, options = _tagged_calls(
        tools, lambda name: json.dumps(f"<tool_call>{name}") + " NL",
        lambda key, schema: json.dumps(f"<arg_key>{key}</arg_key>") + ' NL "<arg_value>"', "</arg_value>", "NL",
        json.dumps("</tool_call>"))
    return ["NL: /\\n?/", *rules], " | ".join(options)


HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>")
DEEPSEEK_MARKERS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁calls▁end｜>")
MISTRAL_MARKERS = ("[TOOL_CALLS]",)
KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                "<|tool_call_end|>", "<|tool_calls_section_end|>")
MARKERS = HARMONY_MARKERS + DEEPSEEK_MARKERS + MISTRAL_MARKERS + KIMI_MARKERS


def _marker(special: Mapping[str, int], marker: str) -> str:
    """A markup string as a Lark terminal: the special token's id where the tokenizer has it as one."""
    return f"<[{special[marker]}]>" if marker in special else json.dumps(marker)


def _deepseek_calls(tools: Sequence[dict[str, Any]], special: Mapping[str, int], v31: bool) -> list[str]:
    """DeepSeek-V3's call section: one call per tool rule, V3's fenced form (``function<sep>N\n```json\n{...}
    \n```) or V3.1's (``N<sep>{...}``), calls separated by an optional newline as the template writes them."""
    begins, begin, sep, end, ends = (_marker(special, m) for m in DEEPSEEK_MARKERS)
    rules, options = [], []
    for t, tool in enumerate(tools):
        function = tool.get("function", tool)
        parameters = function.get("parameters") or function.get("input_schema") or {"type": "object"}
        args = f"%json {json.dumps({**parameters, 'x-guidance': JSON_LAYOUT})}"
        name = json.dumps(function["name"])
        if v31:
            rules.append(f"f{t}: {begin} {name} {sep} {args} {end}")
        else:
            rules.append(f'f{t}: {begin} "function" {sep} {json.dumps(function["name"] + chr(10) + "```json" + chr(10))} '
                         f'{args} {json.dumps(chr(10) + "```")} {end}')
        options.append(f"f{t}")
    return [*rules, f"call: {' | '.join(options)}", f"section_open: {begins}", f"section_close: {ends}"]


def _kimi_calls(tools: Sequence[dict[str, Any]], special: Mapping[str, int]) -> list[str]:
    """Kimi's call section: each call ``functions.NAME:INDEX`` and its arguments, calls separated by an optional
    newline."""
    begins, begin, args_begin, end, ends = (_marker(special, m) for m in KIMI_MARKERS)
    rules, options = ["INDEX: /[0-9]+/"], []
    for t, tool in enumerate(tools):
        function = tool.get("function", tool)
        parameters = function.get("parameters") or function.get("input_schema") or {"type": "object"}
        rules.append(f"f{t}: {begin} {json.dumps('functions.' + function['name'] + ':')} INDEX {args_begin} "
                     f"%json {json.dumps({**parameters, 'x-guidance': JSON_LAYOUT})} {end}")
        options.append(f"f{t}")
    return [*rules, f"call: {' | '.join(options)}", f"section_open: {begins}", f"section_close: {ends}"]


def _mistral_calls(tools: Sequence[dict[str, Any]], special: Mapping[str, int], parallel: bool) -> list[str]:
    """Mixtral's ``[TOOL_CALLS]``, an optional space (its template writes one) and one JSON array of call
    objects (one object when not ``parallel``)."""
    array = {"type": "array", "items": {k: v for k, v in _call_schema(tools).items() if k != "x-guidance"},
             "minItems": 1, **({} if parallel else {"maxItems": 1}), "x-guidance": JSON_LAYOUT}
    return [f"calls: {_marker(special, '[TOOL_CALLS]')} \" \"? %json {json.dumps(array)}"]


def _harmony(tools: Sequence[dict[str, Any]], special: Mapping[str, int]) -> list[str]:
    """gpt-oss's harmony answer after ``<|start|>assistant``: an optional analysis message, then one call on the
    commentary channel (``<|call|>`` ends the turn) as gpt-oss writes it, its arguments JSON of the tool's
    schema. Markers the tokenizer has as special tokens are referenced by id (``<[id]>``)."""
    ch, msg, end, start, constrain, call = (_marker(special, x) for x in HARMONY_MARKERS)
    if "<|end|>" in special:  # text up to a special token: the token itself ends it
        rules = ["TEXT: /(.|\\n)*/", f'analysis: {ch} "analysis" {msg} TEXT {end} {start} "assistant"']
    else:
        rules = [f"analysis_rest[lazy]: /(.|\\n)*/ {end}", f'analysis: {ch} "analysis" {msg} analysis_rest {start} "assistant"']
    options = []
    for t, tool in enumerate(tools):
        function = tool.get("function", tool)
        parameters = function.get("parameters") or function.get("input_schema") or {"type": "object"}
        to = json.dumps(f" to=functions.{function['name']}")
        rules.append(f'f{t}: {ch} "commentary" {to} (" " {constrain}? "json")? {msg} '
                     f'%json {json.dumps({**parameters, "x-guidance": JSON_LAYOUT})} {call}')
        options.append(f"f{t}")
    return [*rules, f"start: analysis? ({' | '.join(options)})"]


def tool_call_grammar(tool_format: str, tools: Sequence[dict[str, Any]], *, parallel: bool = True,
                      reasoning: str = "optional", xml_calls: bool = False, dsml_block: str = "function_calls",
                      deepseek_v31: bool = False, special: Mapping[str, int] | None = None) -> Grammar | None:
    """The grammar of an answer that is one or more calls (one when not ``parallel``) of ``tools`` in
    ``tool_format``, or None where moed has no grammar for that syntax. ``xml_calls``: Qwen3-Coder's XML body
    (Qwen3-Coder, Qwen3.5 / 3.6) inside the Hermes block; ``dsml_block``: "function_calls" (DeepSeek-V3.2) or
    "tool_calls" (DeepSeek-V4); ``deepseek_v31``: V3.1's call form; ``special``: the markers the tokenizer has as
    special tokens, by id. ``reasoning``: "optional" (a reasoning block may come first), "open" (the
    prompt opened one: the answer starts inside it) or "none" (the prompt closed it, as Qwen3's template does
    without thinking)."""
    if not tools or tool_format not in GRAMMAR_FORMATS:
        return None
    lines = ["%llguidance {}"]
    if tool_format == "harmony":  # one call a turn: <|call|> ends it
        return Grammar("lark", "\n".join(lines + _harmony(tools, special or {})) + "\n")
    special = special or {}
    if tool_format == "mistral":
        lines += _mistral_calls(tools, special, parallel)
        tags, gap = None, "GAP: /[ \\n]*/"
    elif tool_format == "gemma4":
        options = []
        for t, tool in enumerate(tools):
            function = tool.get("function", tool)
            parameters = function.get("parameters") or function.get("input_schema") or {"type": "object"}
            lines.append(f"f{t}: {json.dumps('<|tool_call>call:' + function['name'])} "
                         f"%json {json.dumps({**parameters, 'x-guidance': JSON_LAYOUT})} \"<tool_call|>\"")
            options.append(f"f{t}")
        lines.append(f"call: {' | '.join(options)}")
        lines.append("calls: " + ("call" if not parallel else "call+"))
        tags, gap = REASONING["gemma4"], "GAP: /[ \\n]*/"
    elif tool_format == "llama4":
        lines.append("call: %json " + json.dumps(_call_schema(tools, "parameters")))
        lines.append("calls: " + ("call" if not parallel else 'call ("; " call)*'))
        tags, gap = None, "GAP: /[ \\n]*/"
    elif tool_format in ("deepseek", "kimi"):  # a section of calls between two markers
        lines += _kimi_calls(tools, special) if tool_format == "kimi" else _deepseek_calls(tools, special, deepseek_v31)
        lines.append("calls: section_open " + ("call" if not parallel else 'call ("\\n"? call)*') + " section_close")
        tags, gap = REASONING[tool_format], "GAP: /[ \\n]*/"
    elif tool_format in ("dsml", "minimax"):
        rules, invoke = _dsml_calls(tools, DSML if tool_format == "dsml" else "")
        lines += rules
        one = invoke if not parallel else f"{invoke}+"
        opened, closed = ((f"<{DSML}{dsml_block}>", f"</{DSML}{dsml_block}>") if tool_format == "dsml"
                          else ("<minimax:tool_call>", "</minimax:tool_call>"))
        lines.append(f'calls: {json.dumps(opened + chr(10))} {one} {json.dumps(closed)}')
        tags, gap = ("<think>", "</think>"), "GAP: /\\n*/"
    else:
        if xml_calls or tool_format == "glm":
            rules, call = _xml_calls(tools) if tool_format != "glm" else _glm_calls(tools)
            lines += rules
            lines.append(f"call: {call}")
        else:
            lines.append('call: "<tool_call>\\n" %json ' + json.dumps(_call_schema(tools)) + ' "\\n</tool_call>"')
        between = "NL" if tool_format == "glm" else '"\\n"'  # GLM-4.7 writes calls back to back
        lines.append("calls: " + ("call" if not parallel else f"call ({between} call)*"))
        tags, gap = REASONING.get(tool_format), "GAP: /[ \\n]*/"
    if tags is None or reasoning == "none":
        lines.append(gap)
        lines.append("start: GAP calls" if tool_format in ("dsml", "minimax") else "start: calls")
    else:
        opened, closed = (json.dumps(t) for t in tags)
        lines.append(f"think_rest[lazy]: /(.|\\n)*/ {closed}")
        lines.append(gap)
        lines.append("start: think_rest GAP calls" if reasoning == "open" else f"start: ({opened} think_rest GAP)? calls")
    return Grammar("lark", "\n".join(lines) + "\n")


def after_reasoning(grammar: Grammar, tags: tuple[str, str], reasoning: str) -> Grammar:
    """A JSON-schema answer (``response_format`` ...) of a family that reasons in ``tags`` first: the reasoning
    block stays free ("optional": the model may open one; "open": the prompt opened it) and the schema applies
    to the answer after it, as vLLM's reasoning-aware structured output does. Other grammars, and "none" (the
    template closed the block), are returned as they are."""
    if grammar.kind != "json_schema" or reasoning not in ("optional", "open"):
        return grammar
    schema = json.loads(grammar.text)
    opened, closed = (json.dumps(t) for t in tags)
    lines = ["%llguidance {}", f"think_rest[lazy]: /(.|\\n)*/ {closed}", "GAP: /[ \\n]*/",
             "answer: %json " + json.dumps({**schema, "x-guidance": {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}}),
             "start: think_rest GAP answer" if reasoning == "open" else f"start: ({opened} think_rest GAP)? answer"]
    return Grammar("lark", "\n".join(lines) + "\n")


__all__ = ["GRAMMAR_FORMATS", "JSON_WRAPPED", "MARKERS", "after_reasoning", "tool_call_grammar"]
