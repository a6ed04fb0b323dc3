"""ChatRequest: the one request type the three chat APIs translate into, and what is done to it for every API.

OpenAI Chat Completions, OpenAI Responses and Anthropic Messages each parse their wire format and
build a ``ChatRequest``: HF-style messages (``{"role", "content"}``, assistant ``tool_calls``,
``{"role": "tool", "tool_call_id", "name", "content"}``), the tools to offer (OpenAI-style function
schemas, after ``tool_choice``), template variables, the sampling parameters and the output
budget. ``EngineBridge.prepare_chat`` then renders it with the model's template (in the model's
own tool syntax, or the generic one of ``moed.text.generic_tools``), checks that it fits the
context, and opens the stream with the output parser of the model's family. Only the framing of
the answer (SSE event names, JSON shapes) stays per API.

Shared rules applied here, the same whichever API a request came through:

* ``system`` messages after the conversation has started (Claude Code sends them, under the
  ``mid-conversation-system`` beta) are folded into the nearest user turn: chat templates accept a
  system message only first (Qwen3's raises otherwise) and many refuse roles out of alternation.
* Content the model cannot see (images, documents, audio) was replaced by each API with a short
  placeholder text (``media_placeholder``) and counted in ``dropped_media`` for the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from moed.engine.sampling import SamplingParams

log = logging.getLogger("moed.http")


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-style {"type": "function", "function"}
    template_variables: dict[str, Any] = field(default_factory=dict)
    params: SamplingParams = field(default_factory=SamplingParams)  # max_tokens is replaced by prepare_chat
    max_tokens: int | None = None  # None: the rest of the context
    stream: bool = False
    prefill: bool = False  # the last message is an assistant turn the answer continues (Anthropic)
    dropped_media: int = 0  # image / document / audio parts given to a text-only model
    forced_tools: bool = False  # tool_choice "required" / named (Anthropic "any" / "tool"): the answer is calls
    parallel_tool_calls: bool = True  # more than one call may be made (forced calls: the grammar says how many)
    reasoning_budget: int | None = None  # at most this many tokens of reasoning (Anthropic's thinking budget_tokens)


def media_placeholder(kind: str, detail: str = "") -> str:
    """The text that stands in for an image / document the model cannot see."""
    what = f"{kind}: {detail}" if detail else kind
    return f"[{what} omitted: this model reads text only]"


def warn_dropped_media(count: int, model: str) -> None:
    if count:
        log.warning("model %s reads text only: %d image/document part(s) of a request were replaced by a "
                    "placeholder text", model, count)


def fold_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Leading system messages joined into one; later ones folded into user turns.

    A later system message's text is appended to the user turn right before it, or (when an
    assistant turn or nothing precedes it) put first in the next user turn, or becomes a user
    turn of its own when the conversation ends with it."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # system texts waiting for the next user turn
    for msg in messages:
        role = msg.get("role")
        if role == "system":
            text = msg.get("content") or ""
            if all(m["role"] == "system" for m in out):  # still the leading run
                if out:
                    out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if text else out[0]["content"]}
                else:
                    out.append({"role": "system", "content": text})
            elif out[-1]["role"] == "user" and not out[-1].get("tool_calls"):
                out[-1] = {**out[-1], "content": _join(out[-1]["content"], text)}
            elif text:
                pending.append(text)
            continue
        msg = dict(msg)
        if role == "user":
            if pending:
                msg["content"] = _join("\n\n".join(pending), msg.get("content") or "")
                pending = []
        out.append(msg)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _join(a: str, b: str) -> str:
    return f"{a}\n\n{b}" if a and b else a or b
