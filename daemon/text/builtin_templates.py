"""Chat templates moed ships for families whose checkpoints come without one.

DeepSeek-V3.2 and DeepSeek-V4 are published with a Python encoder (``encoding/encoding_dsv32.py``,
``encoding/encoding_dsv4.py``) and no Jinja chat template; llama.cpp and SGLang ship their own templates for
V3.2, and moed ships one for each: ``DEEPSEEK_V32`` and ``DEEPSEEK_V4`` below render the same prompt text as the
encoders (written from their rules; tests/text/test_builtin_templates.py holds prompts the encoders produced).
A checkpoint's own template always wins: these are used only where it has none.
"""

from __future__ import annotations

DEEPSEEK_V32 = r'''{#- DeepSeek-V3.2's prompt format, written by moed: the checkpoint ships only a Python encoder
    (encoding/encoding_dsv32.py), no chat template. Thinking mode when enable_thinking (or thinking) is true,
    chat mode otherwise; reasoning of turns before the last user message is dropped. Every user turn and the
    last tool result open the assistant turn themselves, so add_generation_prompt changes nothing. -#}
{%- set thinking_on = (enable_thinking if enable_thinking is defined else (thinking if thinking is defined else false)) -%}
{%- set dsml = '｜DSML｜' -%}
{%- set nl = '\n' -%}
{%- set ns = namespace(last_user=-1, tools_done=false) -%}
{%- for m in messages -%}{%- if m['role'] in ['user', 'developer'] -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- macro tools_block() -%}
{{- '## Tools' ~ nl ~ nl ~ "You have access to a set of tools you can use to answer the user's question." ~ nl -}}
{{- 'You can invoke functions by writing a "<' ~ dsml ~ 'function_calls>" block like the following as part of your reply to the user:' ~ nl -}}
{{- '<' ~ dsml ~ 'function_calls>' ~ nl ~ '<' ~ dsml ~ 'invoke name="$FUNCTION_NAME">' ~ nl -}}
{{- '<' ~ dsml ~ 'parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</' ~ dsml ~ 'parameter>' ~ nl -}}
{{- '...' ~ nl ~ '</' ~ dsml ~ 'invoke>' ~ nl ~ '<' ~ dsml ~ 'invoke name="$FUNCTION_NAME2">' ~ nl ~ '...' ~ nl -}}
{{- '</' ~ dsml ~ 'invoke>' ~ nl ~ '</' ~ dsml ~ 'function_calls>' ~ nl ~ nl -}}
{{- 'String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).' ~ nl ~ nl -}}
{{- 'If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:' ~ nl ~ nl -}}
{{- '<' ~ dsml ~ 'function_calls>' ~ nl ~ '...' ~ nl ~ '</' ~ dsml ~ 'function_calls>' ~ nl ~ nl -}}
{{- '<function_results>' ~ nl ~ '...' ~ nl ~ '</function_results>' ~ nl ~ nl -}}
{{- '<think>...thinking about results</think>' ~ nl ~ nl -}}
{{- 'Here are the functions available in JSONSchema format:' ~ nl ~ '<functions>' ~ nl -}}
{%- for t in tools -%}{{- (t['function'] if t['function'] is defined else t) | tojson -}}{{- nl if not loop.last else '' -}}{%- endfor -%}
{{- nl ~ '</functions>' ~ nl -}}
{%- endmacro -%}
{{- bos_token if bos_token is defined else '<｜begin▁of▁sentence｜>' -}}
{%- if tools and messages[0]['role'] != 'system' -%}{{- tools_block() -}}{%- set ns.tools_done = true -%}{%- endif -%}
{%- for m in messages -%}
{%- set i = loop.index0 -%}
{%- if m['role'] == 'system' -%}
{{- m['content'] or '' -}}
{%- if tools and not ns.tools_done -%}{{- nl ~ nl ~ tools_block() -}}{%- set ns.tools_done = true -%}{%- endif -%}
{%- elif m['role'] in ['user', 'developer'] -%}
{{- '<｜User｜>' ~ (m['content'] or '') ~ '<｜Assistant｜>' -}}
{{- '<think>' if (i == ns.last_user and thinking_on) else '</think>' -}}
{%- elif m['role'] == 'tool' -%}
{%- if i == 0 or messages[i - 1]['role'] != 'tool' -%}{{- nl ~ nl ~ '<function_results>' -}}{%- endif -%}
{{- nl ~ '<result>' ~ (m['content'] or '') ~ '</result>' -}}
{%- if loop.last or messages[i + 1]['role'] != 'tool' -%}
{{- nl ~ '</function_results>' ~ nl ~ nl ~ ('<think>' if (i >= ns.last_user and thinking_on) else '</think>') -}}
{%- endif -%}
{%- elif m['role'] == 'assistant' -%}
{%- if thinking_on and i > ns.last_user -%}{{- (m['reasoning_content'] or '') ~ '</think>' -}}{%- endif -%}
{{- m['content'] or '' -}}
{%- if m['tool_calls'] -%}
{{- nl ~ nl ~ '<' ~ dsml ~ 'function_calls>' ~ nl -}}
{%- for c in m['tool_calls'] -%}
{%- set f = c['function'] if c['function'] is defined else c -%}
{{- '<' ~ dsml ~ 'invoke name="' ~ f['name'] ~ '">' ~ nl -}}
{%- for k, v in (f['arguments'] or {}).items() -%}
{{- '<' ~ dsml ~ 'parameter name="' ~ k ~ '" string="' ~ ('true' if v is string else 'false') ~ '">' -}}
{{- (v if v is string else (v | tojson)) ~ '</' ~ dsml ~ 'parameter>' ~ (nl if not loop.last else '') -}}
{%- endfor -%}
{{- nl ~ '</' ~ dsml ~ 'invoke>' ~ (nl if not loop.last else '') -}}
{%- endfor -%}
{{- nl ~ '</' ~ dsml ~ 'function_calls>' -}}
{%- endif -%}
{{- '<｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- endfor -%}
'''

DEEPSEEK_V4 = r'''{#- DeepSeek-V4's prompt format, written by moed: the checkpoint ships only a Python encoder
    (encoding/encoding_dsv4.py), no chat template. Thinking mode when enable_thinking (or thinking) is true,
    chat mode otherwise; reasoning_effort "max" puts the encoder's maximum-effort preamble first. Tool results
    are user turns (<tool_result>, merged with the user messages around them); the request's tools go after
    the system message (an empty one when there is none). Without tools the reasoning of turns before the last
    user turn is dropped; with tools every turn keeps it. Every user turn opens the assistant turn itself, so
    add_generation_prompt changes nothing. -#}
{%- set thinking_on = (enable_thinking if enable_thinking is defined else (thinking if thinking is defined else false)) -%}
{%- set dsml = '｜DSML｜' -%}
{%- set nl = '\n' -%}
{%- set keep = true if tools else false -%}
{%- set ns = namespace(last_user=-1, prev='') -%}
{%- for m in messages -%}
{%- if m['role'] == 'developer' or (m['role'] in ['user', 'tool'] and ns.prev not in ['user', 'tool']) -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- if m['tools'] is defined and m['tools'] -%}{%- set keep = true -%}{%- endif -%}
{%- set ns.prev = m['role'] -%}
{%- endfor -%}
{%- macro tools_block(list) -%}
{{- '## Tools' ~ nl ~ nl ~ "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<" ~ dsml ~ "tool_calls>\" block like the following:" ~ nl ~ nl -}}
{{- '<' ~ dsml ~ 'tool_calls>' ~ nl ~ '<' ~ dsml ~ 'invoke name="$TOOL_NAME">' ~ nl -}}
{{- '<' ~ dsml ~ 'parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</' ~ dsml ~ 'parameter>' ~ nl -}}
{{- '...' ~ nl ~ '</' ~ dsml ~ 'invoke>' ~ nl ~ '<' ~ dsml ~ 'invoke name="$TOOL_NAME2">' ~ nl ~ '...' ~ nl -}}
{{- '</' ~ dsml ~ 'invoke>' ~ nl ~ '</' ~ dsml ~ 'tool_calls>' ~ nl ~ nl -}}
{{- 'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.' ~ nl ~ nl -}}
{{- 'If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.' ~ nl ~ nl -}}
{{- 'Otherwise, output directly after </think> with tool calls or final response.' ~ nl ~ nl -}}
{{- '### Available Tool Schemas' ~ nl ~ nl -}}
{%- for t in list -%}{{- (t['function'] if t['function'] is defined else t) | tojson -}}{{- nl if not loop.last else '' -}}{%- endfor -%}
{{- nl ~ nl ~ 'You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.' ~ nl -}}
{%- endmacro -%}
{{- bos_token if bos_token is defined else '<｜begin▁of▁sentence｜>' -}}
{%- if thinking_on and reasoning_effort is defined and reasoning_effort == 'max' -%}
{{- 'Reasoning Effort: Absolute maximum with no shortcuts permitted.' ~ nl -}}
{{- 'You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.' ~ nl -}}
{{- 'Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.' ~ nl ~ nl -}}
{%- endif -%}
{%- if tools and (not messages or messages[0]['role'] != 'system') -%}{{- nl ~ nl ~ tools_block(tools) -}}{%- endif -%}
{%- for m in messages -%}
{%- set i = loop.index0 -%}
{%- set role = m['role'] -%}
{%- set next_role = messages[i + 1]['role'] if not loop.last else '' -%}
{%- set first_of_run = i == 0 or messages[i - 1]['role'] not in ['user', 'tool'] -%}
{%- if role == 'system' -%}
{{- m['content'] or '' -}}
{%- set own = m['tools'] if (m['tools'] is defined and m['tools']) else (tools if (i == 0 and tools) else none) -%}
{%- if own -%}{{- nl ~ nl ~ tools_block(own) -}}{%- endif -%}
{%- elif role == 'developer' -%}
{%- if keep or not thinking_on or i >= ns.last_user -%}
{{- '<｜User｜>' ~ (m['content'] or '') -}}
{%- if m['tools'] is defined and m['tools'] -%}{{- nl ~ nl ~ tools_block(m['tools']) -}}{%- endif -%}
{%- endif -%}
{%- elif role in ['user', 'tool'] -%}
{{- '<｜User｜>' if first_of_run else nl ~ nl -}}
{%- if role == 'tool' -%}{{- '<tool_result>' ~ (m['content'] or '') ~ '</tool_result>' -}}{%- else -%}{{- m['content'] or '' -}}{%- endif -%}
{%- elif role == 'assistant' -%}
{%- if thinking_on and (keep or i > ns.last_user) -%}{{- (m['reasoning_content'] or '') ~ '</think>' -}}{%- endif -%}
{{- m['content'] or '' -}}
{%- if m['tool_calls'] -%}
{{- nl ~ nl ~ '<' ~ dsml ~ 'tool_calls>' ~ nl -}}
{%- for c in m['tool_calls'] -%}
{%- set f = c['function'] if c['function'] is defined else c -%}
{%- set args = f['arguments'] if f['arguments'] is mapping else {'arguments': f['arguments']} -%}
{{- '<' ~ dsml ~ 'invoke name="' ~ f['name'] ~ '">' ~ nl -}}
{%- for k, v in args.items() -%}
{{- '<' ~ dsml ~ 'parameter name="' ~ k ~ '" string="' ~ ('true' if v is string else 'false') ~ '">' -}}
{{- (v if v is string else (v | tojson)) ~ '</' ~ dsml ~ 'parameter>' ~ (nl if not loop.last else '') -}}
{%- endfor -%}
{{- nl ~ '</' ~ dsml ~ 'invoke>' ~ (nl if not loop.last else '') -}}
{%- endfor -%}
{{- nl ~ '</' ~ dsml ~ 'tool_calls>' -}}
{%- endif -%}
{{- '<｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- if role in ['user', 'tool', 'developer'] and next_role in ['assistant', ''] -%}
{%- if role != 'developer' or keep or not thinking_on or i >= ns.last_user -%}
{{- '<｜Assistant｜>' ~ ('<think>' if (thinking_on and (keep or i >= ns.last_user)) else '</think>') -}}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
'''

_BUILTIN = {
    "deepseek_v32": (DEEPSEEK_V32, "moed's DeepSeek-V3.2 template (the checkpoint ships a Python encoder, no chat template)"),
    "deepseek_v4": (DEEPSEEK_V4, "moed's DeepSeek-V4 template (the checkpoint ships a Python encoder, no chat template)"),
}


def builtin_template(name: str) -> tuple[str, str] | None:
    """(template, where it comes from) for a template a family names (``Family.chat_template``), else None."""
    return _BUILTIN.get(name)
