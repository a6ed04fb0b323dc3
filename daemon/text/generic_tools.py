"""The generic tool format: tools for a model whose chat template has no tool syntax.

Agents send tools on every request, and many models (community fine-tunes, most GGUF files, the
demo model) have a template that renders only ``role`` and ``content``. For them moed does what
llama-server does: the tool schemas go into the system prompt as text, with an instruction to
answer with a JSON call wrapped in tags, and the calls are parsed back out of the answer::

    <tool_call>
    {"name": "read", "arguments": {"path": "hello.txt"}}
    </tool_call>

That is the Hermes wrapper Qwen and many fine-tunes were trained on, so models that know any tool
syntax most likely know this one; it is parsed by the Hermes parser (``output_parsers.hermes``)
with the model's own end-of-turn tokens. The conversation's earlier tool traffic is rewritten
into the same text: an assistant turn's calls become ``<tool_call>`` blocks after its text, and
tool results become user turns of ``<tool_response>`` blocks (consecutive ones merged), since a
template without tool syntax would drop or refuse them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from moed.text.output_parsers.hermes import CALL_CLOSE, CALL_OPEN, HermesParser

RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

INSTRUCTIONS = (
    "# Tools\n\n"
    "You can call the tools below. Each is described by its name, description and the JSON schema of its "
    "arguments:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a tool, answer with a block like this for each call (the arguments a JSON object that fits the "
    "tool's schema), and write nothing after the last block:\n"
    f"{CALL_OPEN}\n{{{{\"name\": \"<tool name>\", \"arguments\": {{{{...}}}}}}}}\n{CALL_CLOSE}\n\n"
    f"Each tool's result comes back in the next user turn inside {RESPONSE_OPEN}{RESPONSE_CLOSE}. "
    "Answer without a block when no tool is needed."
)


def tool_descriptions(tools: Sequence[dict[str, Any]]) -> str:
    """One JSON line per tool: {"name", "description", "parameters"} (OpenAI-style function schemas in)."""
    lines = []
    for tool in tools:
        function = tool.get("function", tool)
        entry = {"name": function.get("name")}
        if function.get("description"):
            entry["description"] = function["description"]
        entry["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "\n".join(lines)


def tools_system_text(tools: Sequence[dict[str, Any]]) -> str:
    return INSTRUCTIONS.format(tools=tool_descriptions(tools))


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # a JSON string from an OpenAI client: shown as the object it holds
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def generic_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """HF-style messages with tool schemas, calls and results written as text (see the module doc).

    ``tools`` empty: the instructions are left out, but earlier calls and results are still
    rewritten (a template without tool syntax cannot show them otherwise)."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            text = msg.get("content") or ""
            calls = "\n".join(_call_text(c) for c in msg["tool_calls"])
            new = {k: v for k, v in msg.items() if k != "tool_calls"}
            new["content"] = f"{text}\n\n{calls}" if text.strip() else calls
            out.append(new)
        elif role == "tool":
            block = f"{RESPONSE_OPEN}\n{msg.get('content') or ''}\n{RESPONSE_CLOSE}"
            last = out[-1] if out else None
            if last is not None and last["role"] == "user" and last.get("_tool_results"):
                last["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif role == "user" and out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
            out[-1]["content"] += "\n\n" + (msg.get("content") or "")  # text after the results, in one turn
            out[-1]["_tool_results"] = False
        else:
            out.append(dict(msg))
    for msg in out:
        msg.pop("_tool_results", None)
    if tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


class GenericToolParser(HermesParser):
    """Hermes ``<tool_call>`` parsing with the model's own end-of-turn tokens (which never become text)."""

    tool_format = "generic"

    def __init__(self, *, end_tokens: Sequence[str] = (), think_tags: tuple[str, str] | None = None,
                 **options: Any) -> None:
        self.end_tokens = tuple(dict.fromkeys((*end_tokens, *HermesParser.end_tokens)))
        self.think_tags = think_tags
        super().__init__(**options)
