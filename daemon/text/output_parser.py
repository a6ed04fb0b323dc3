"""Which output parser a model gets, and whether it can take tools: the HTTP layer's entry point.

A model family names its output format (``Family.tool_format`` in ``moed.models.families``; the runtime
exposes it as ``ModelRuntime.tool_format``). The HTTP layer decodes generated ids with special tokens kept
and feeds the text through that format's parser, which splits it into text, reasoning and tool-call events
(see ``moed.text.output_parsers.base`` for the event and tool-call rules, and each format's module for its
grammar)::

    parser = output_parser_for(runtime.tool_format, tools=bool(request.tools),
                               starts_in_reasoning=prompt_opens_reasoning(runtime.tool_format, prompt))
    for delta in deltas:
        for event in parser.feed(delta): ...
    for event in parser.finish(): ...
    parser.tool_calls  # the complete calls: ToolCall(index, id, name, arguments JSON text)
    parser.incomplete_tool_calls  # calls whose first event went out but that never completed
    parser.saw_tool_call  # some tool_call event went out

Formats: ``qwen3`` (Hermes ``<tool_call>`` + ``<think>``, and Qwen3-Coder's XML calls in the same block),
``hermes`` (Qwen2-MoE), ``harmony`` (gpt-oss channels), ``deepseek`` (DeepSeek-V3's tool-call tokens +
``<think>``), ``dsml`` (DeepSeek-V3.2 / V4 DSML invokes + ``<think>``), ``glm`` (GLM-4.5 .. GLM-5
``<tool_call>`` with ``<arg_key>`` / ``<arg_value>`` pairs + ``<think>``), ``minimax`` (MiniMax-M2's
``<minimax:tool_call>`` XML invokes + ``<think>``), ``mistral`` (``[TOOL_CALLS]``), ``llama4`` (Llama-4's JSON call
object or pythonic call list opening the answer), ``gemma4`` (``<|tool_call>call:NAME{...}<tool_call|>`` with
``<|"|>`` strings, ``<|channel>thought`` reasoning), ``kimi`` (Kimi-K2 / Kimi-Linear's ``<|tool_calls_section_begin|>``
section of ``functions.NAME:i`` calls, ``<think>``),
``plain`` (all text, no tools). A model whose template cannot render tools (or whose format has no tool
syntax) gets the generic format of ``moed.text.generic_tools`` instead: every model can take tools.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from moed.text.chat_template import template_renders_tools
from moed.text.generic_tools import GenericToolParser
from moed.text.output_parsers.base import OutputEvent, OutputParser, ToolCall
from moed.text.output_parsers.deepseek import DeepSeekParser
from moed.text.output_parsers.dsml import DsmlParser
from moed.text.output_parsers.gemma4 import Gemma4Parser
from moed.text.output_parsers.glm import GlmParser
from moed.text.output_parsers.harmony import HarmonyParser
from moed.text.output_parsers.hermes import HermesParser, Qwen3Parser
from moed.text.output_parsers.kimi import KimiParser
from moed.text.output_parsers.llama import LlamaParser
from moed.text.output_parsers.minimax import MiniMaxParser
from moed.text.output_parsers.mistral import MistralParser
from moed.text.output_parsers.plain import PlainParser

__all__ = ["OutputEvent", "OutputParser", "ToolCall", "TOOL_FORMATS", "FORMATS", "output_parser_for",
           "prompt_opens_reasoning", "has_native_tools", "reasoning_tags"]

_PARSERS: dict[str, type[OutputParser]] = {
    "qwen3": Qwen3Parser,
    "hermes": HermesParser,
    "harmony": HarmonyParser,
    "deepseek": DeepSeekParser,
    "dsml": DsmlParser,
    "glm": GlmParser,
    "mistral": MistralParser,
    "minimax": MiniMaxParser,
    "llama4": LlamaParser,
    "gemma4": Gemma4Parser,
    "kimi": KimiParser,
}
TOOL_FORMATS = frozenset(_PARSERS)  # formats with a tool-call syntax
FORMATS = TOOL_FORMATS | {"plain"}  # every format a family may name


def output_parser_for(tool_format: str, *, tools: bool, reasoning: bool = True, starts_in_reasoning: bool = False,
                      tool_names: Collection[str] | None = None, stream_arguments: bool = True,
                      tool_parameters: Mapping[str, Any] | None = None, generic_tools: bool = False,
                      end_tokens: Collection[str] = ()) -> OutputParser:
    """A fresh parser for one response of a model whose family writes ``tool_format`` (``FORMATS``).

    tools: the request offered tools; without them tool-call markup stays text.
    reasoning: emit reasoning events; False parses reasoning out of the text but drops it.
    starts_in_reasoning: the prompt opened a reasoning block (see ``prompt_opens_reasoning``).
    tool_names: the offered tool names; a call to any other name comes out as text.
    stream_arguments: stream a call's arguments as they arrive (default) or send each call whole.
    tool_parameters: tool name -> the JSON schema of its parameters; formats that write raw values
        (Qwen3-Coder's XML calls) use it to type them, otherwise the values are strings.
    """
    cls = _PARSERS.get(tool_format, PlainParser)
    if tools and generic_tools and not issubclass(cls, HermesParser):
        return GenericToolParser(end_tokens=(*cls.end_tokens, *end_tokens), think_tags=cls.think_tags, tools=True,
                                 reasoning=reasoning, starts_in_reasoning=starts_in_reasoning, tool_names=tool_names,
                                 stream_arguments=stream_arguments, tool_parameters=tool_parameters)
    return cls(tools=tools and cls is not PlainParser, reasoning=reasoning, starts_in_reasoning=starts_in_reasoning,
               tool_names=tool_names, stream_arguments=stream_arguments, tool_parameters=tool_parameters)


def has_native_tools(tool_format: str, chat_template: str | None) -> bool:
    """The format has a tool-call syntax AND the chat template renders ``tools`` into the prompt.

    Pass the template that will render a request with tools: the tokenizer's "tool_use" template
    when it has one, else its default (``Tokenizer.tool_chat_template``)."""
    return tool_format in _PARSERS and template_renders_tools(chat_template)


def reasoning_tags(tool_format: str) -> tuple[str, str] | None:
    """The tags a family's reasoning block opens and closes with (``("<think>", "</think>")``), None without."""
    return _PARSERS.get(tool_format, PlainParser).think_tags


def prompt_opens_reasoning(tool_format: str, prompt: str) -> bool:
    """The rendered prompt ends inside an open reasoning block (``...<think>\\n``): the output starts in it."""
    tags = _PARSERS.get(tool_format, PlainParser).think_tags
    return bool(tags) and prompt.rstrip().endswith(tags[0])
