"""Small but faithful tools-capable chat templates for the tiny test tokenizer, and a way to install them.

What is here:

* ``QWEN3_TOOL_TEMPLATE``: Qwen3's Hermes-style template, cut down to what matters for tools:
  ``tools`` go into the system prompt inside ``<tools></tools>`` (one JSON object per line), an
  assistant's ``tool_calls`` become ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  blocks (arguments given as a JSON string are written as is), consecutive ``tool`` messages become
  ``<tool_response>`` blocks in one user turn, and ``enable_thinking=False`` closes an empty
  ``<think>`` block after the generation prompt. Uses the tiny tokenizer's ChatML tokens.
* ``GPT_OSS_TOOL_TEMPLATE``: a harmony (gpt-oss) template: system + developer messages (tools
  in a ``namespace functions`` block, their parameters as JSON rather than harmony's TypeScript
  rendering), user turns, assistant text on the ``final`` channel, tool calls as
  ``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>``, tool
  replies as ``<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...<|end|>``;
  the generation prompt is ``<|start|>assistant``.
* ``WEATHER_TOOL``, ``TIME_TOOL``: OpenAI-style function tools for requests in tests.
* ``install_tool_template(model_dir, template=QWEN3_TOOL_TEMPLATE)``: writes the template to
  ``model_dir/chat_template.jinja`` (which takes priority over tokenizer_config.json's template),
  e.g. on a directory made by ``helpers.tiny_models.build_tiny_model_dir``; returns the path.
"""

from __future__ import annotations

from pathlib import Path

QWEN3_TOOL_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

GPT_OSS_TOOL_TEMPLATE = r"""{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- '<|end|>' }}
{%- if messages[0].role == 'system' or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if messages[0].role == 'system' %}
        {{- '# Instructions\n\n' + messages[0].content }}
        {%- if tools %}{{- '\n\n' }}{%- endif %}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
        {%- for tool in tools %}
            {%- set fn = tool.function if tool.function is defined else tool %}
            {{- '// ' + (fn.description or '') + '\ntype ' + fn.name + ' = (_: ' + (fn.parameters | tojson) + ') => any;\n\n' }}
        {%- endfor %}
        {{- '} // namespace functions' }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- set ns = namespace(last_tool='') %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.content %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set fn = tool_call.function if tool_call.function is defined else tool_call %}
            {%- set ns.last_tool = fn.name %}
            {{- '<|start|>assistant to=functions.' + fn.name + '<|channel|>commentary json<|message|>' }}
            {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}
            {{- '<|call|>' }}
        {%- endfor %}
    {%- elif message.role == 'tool' %}
        {{- '<|start|>functions.' + (message.name or ns.last_tool) + ' to=assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}


def install_tool_template(model_dir: Path | str, template: str = QWEN3_TOOL_TEMPLATE) -> Path:
    """Write ``template`` as ``model_dir/chat_template.jinja`` (it wins over tokenizer_config.json's)."""
    path = Path(model_dir) / "chat_template.jinja"
    path.write_text(template, encoding="utf-8")
    return path
