"""MiniMax-M2 / M2.1 / M2.5 tool calls (XML invokes) and interleaved ``<think>`` reasoning.

Grammar handled (MiniMax's tool-calling guide and chat template write exactly this)::

    [<think> reasoning </think>]  text
    <minimax:tool_call> ws (INVOKE ws)+ </minimax:tool_call>  [text]
    INVOKE: <invoke name="NAME"> ws (<parameter name="KEY">VALUE</parameter> ws)* </invoke>

* Values are written raw; the tool's schema types them (a string stays text, numbers / booleans / arrays /
  objects are read as JSON, as MiniMax's reference parser does); one newline at each end of a value is dropped.
* The prompt opens ``<think>`` (``]~b]ai\\n<think>\\n``): use ``starts_in_reasoning``.
* ``[e~[`` ends the turn and is never text.
* The invokes are DeepSeek's DSML without its ``｜DSML｜`` prefix: the same reader (``dsml.DsmlInvoke``).
"""

from __future__ import annotations

from moed.text.output_parsers.dsml import DsmlParser, InvokeMarkup

MINIMAX_MARKUP = InvokeMarkup(("<minimax:tool_call>",), ("</minimax:tool_call>",), "")
EOS = "[e~["


class MiniMaxParser(DsmlParser):
    tool_format = "minimax"
    end_tokens = (EOS,)
    markup = MINIMAX_MARKUP
    trim_newlines = True
