"""Which output parser a model family gets, and whether it can take tools: the HTTP layer's entry point.

The HTTP layer decodes generated ids with special tokens kept and feeds the text through the
family's parser, which splits it into text, reasoning and tool-call events (see
``moed.text.output_parsers.base`` for the event and tool-call rules, and each family's module
for its grammar)::

    parser = output_parser_for(model.family, tools=bool(request.tools),
                               starts_in_reasoning=prompt_opens_reasoning(model.family, prompt))
    for delta in deltas:
        for event in parser.feed(delta): ...
    for event in parser.finish(): ...
    parser.tool_calls  # the complete calls: ToolCall(index, id, name, arguments JSON text)
    parser.incomplete_tool_calls  # calls whose first event went out but that never completed
    parser.saw_tool_call  # some tool_call event went out

Families and their syntax: qwen3_moe (Hermes ``<tool_call>`` + ``<think>``, and Qwen3-Coder's XML
calls in the same block), qwen2_moe (Hermes), gpt_oss (harmony channels), deepseek_v3 (its
tool-call tokens + ``<think>``), deepseek_v32 (DSML invokes + ``<think>``), glm4_moe and glm_moe_dsa
(``<tool_call>`` with ``<arg_key>`` / ``<arg_value>`` pairs + ``<think>``), mixtral (``[TOOL_CALLS]``); every other family gets the plain
parser (all text, no tools). A model whose template cannot render tools (or whose family has no
tool syntax) gets the generic format of ``moed.text.generic_tools`` instead: every model can take tools.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from moed.text.chat_template import template_renders_tools
from moed.text.generic_tools import GenericToolParser
from moed.text.output_parsers.base import OutputEvent, OutputParser, ToolCall
from moed.text.output_parsers.deepseek import DeepSeekParser
from moed.text.output_parsers.dsml import DsmlParser
from moed.text.output_parsers.glm import GlmParser
from moed.text.output_parsers.harmony import HarmonyParser
from moed.text.output_parsers.hermes import HermesParser, Qwen3Parser
from moed.text.output_parsers.mistral import MistralParser
from moed.text.output_parsers.plain import PlainParser

__all__ = ["OutputEvent", "OutputParser", "ToolCall", "TOOL_FAMILIES", "output_parser_for", "prompt_opens_reasoning",
           "has_native_tools"]

_PARSERS: dict[str, type[OutputParser]] = {
    "qwen3_moe": Qwen3Parser,
    "qwen2_moe": HermesParser,
    "gpt_oss": HarmonyParser,
    "deepseek_v3": DeepSeekParser,
    "deepseek_v32": DsmlParser,
    "glm4_moe": GlmParser,
    "glm_moe_dsa": GlmParser,
    "mixtral": MistralParser,
}
TOOL_FAMILIES = frozenset(_PARSERS)  # families with a tool-call syntax


def output_parser_for(family: str, *, tools: bool, reasoning: bool = True, starts_in_reasoning: bool = False,
                      tool_names: Collection[str] | None = None, stream_arguments: bool = True,
                      tool_parameters: Mapping[str, Any] | None = None, generic_tools: bool = False,
                      end_tokens: Collection[str] = ()) -> OutputParser:
    """A fresh parser for one response of a ``family`` model.

    tools: the request offered tools; without them tool-call markup stays text.
    reasoning: emit reasoning events; False parses reasoning out of the text but drops it.
    starts_in_reasoning: the prompt opened a reasoning block (see ``prompt_opens_reasoning``).
    tool_names: the offered tool names; a call to any other name comes out as text.
    stream_arguments: stream a call's arguments as they arrive (default) or send each call whole.
    tool_parameters: tool name -> the JSON schema of its parameters; formats that write raw values
        (Qwen3-Coder's XML calls) use it to type them, otherwise the values are strings.
    """
    cls = _PARSERS.get(family, PlainParser)
    if tools and generic_tools and not issubclass(cls, HermesParser):
        return GenericToolParser(end_tokens=(*cls.end_tokens, *end_tokens), think_tags=cls.think_tags, tools=True,
                                 reasoning=reasoning, starts_in_reasoning=starts_in_reasoning, tool_names=tool_names,
                                 stream_arguments=stream_arguments, tool_parameters=tool_parameters)
    return cls(tools=tools and cls is not PlainParser, reasoning=reasoning, starts_in_reasoning=starts_in_reasoning,
               tool_names=tool_names, stream_arguments=stream_arguments, tool_parameters=tool_parameters)


def has_native_tools(family: str, chat_template: str | None) -> bool:
    """The family has a tool-call syntax AND the chat template renders ``tools`` into the prompt.

    Pass the template that will render a request with tools: the tokenizer's "tool_use" template
    when it has one, else its default (``Tokenizer.tool_chat_template``)."""
    return family in _PARSERS and template_renders_tools(chat_template)


def prompt_opens_reasoning(family: str, prompt: str) -> bool:
    """The rendered prompt ends inside an open reasoning block (``...<think>\\n``): the output starts in it."""
    tags = _PARSERS.get(family, PlainParser).think_tags
    return bool(tags) and prompt.rstrip().endswith(tags[0])
