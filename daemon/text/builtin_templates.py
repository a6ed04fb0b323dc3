"""Chat templates moed ships for families whose checkpoints come without one.

DeepSeek-V3.2 is published with a Python encoder (``encoding/encoding_dsv32.py``) and no Jinja chat template;
llama.cpp and SGLang ship their own templates for it, and so does moed: ``DEEPSEEK_V32`` below renders the same
prompt text as that encoder (written from its rules; tests/text/test_builtin_templates.py holds prompts it
produced). A checkpoint's own template always wins: these are used only where it has none.
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

_BUILTIN = {
    "deepseek_v32": (DEEPSEEK_V32, "moed's DeepSeek-V3.2 template (the checkpoint ships a Python encoder, no chat template)"),
}


def builtin_template(name: str) -> tuple[str, str] | None:
    """(template, where it comes from) for a template a family names (``Family.chat_template``), else None."""
    return _BUILTIN.get(name)
