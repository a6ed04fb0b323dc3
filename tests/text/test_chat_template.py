"""Chat template rendering: parity with transformers' apply_chat_template, validation and error paths."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import jinja2
import pytest
from helpers.tiny_tokenizer import BOS_TOKEN, CHATML_TEMPLATE, EOS_TOKEN, build_tiny_tokenizer
from transformers import PreTrainedTokenizerFast

from moed.errors import InvalidRequestError, ModelFormatError
from moed.text.chat_template import render_chat, require_chat_template

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Mistral-style: enforces alternating roles with raise_exception.
ALTERNATING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

# Exercises tojson (indent, non-ASCII, HTML characters), loop controls, namespace and block trimming.
TOOLS_TEMPLATE = """{% set ns = namespace(n=0) %}
{% if tools %}
<tools>
{% for tool in tools %}
{{ tool | tojson(indent=2) }}
{{ tool | tojson }}
{% endfor %}
</tools>
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
<{{ message['role'] }}>{{ message['content'] }}</{{ message['role'] }}>
    {% if ns.n >= 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}
"""

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Un café à Paris? 日本 🙂"},
    {"role": "assistant", "content": "  Oui.  "},
    {"role": "user", "content": "<b>& more</b>"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _hf(template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=build_tiny_tokenizer(), bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, chat_template=template
    )


def _ours(template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    return render_chat(template, messages, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, **kw)


@pytest.mark.parametrize(
    "template", [CHATML_TEMPLATE, LLAMA3_TEMPLATE, TOOLS_TEMPLATE], ids=["chatml", "llama3", "tools"]
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(template: str, add_generation_prompt: bool) -> None:
    hf = _hf(template)
    for messages in (CHAT, CHAT[1:2]):
        expected = hf.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        got = _ours(template, messages, tools=TOOLS, add_generation_prompt=add_generation_prompt)
        assert got == expected


def test_llama3_starts_with_bos() -> None:
    out = _ours(LLAMA3_TEMPLATE, CHAT[1:2])
    assert out.startswith(BOS_TOKEN + "<|start_header_id|>user")
    assert out.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_tojson_keeps_unicode_and_html() -> None:
    out = _ours(TOOLS_TEMPLATE, CHAT[1:2], tools=TOOLS)
    assert "Météo <now> & later" in out
    assert '\n  "type": "function",' in out  # indent=2


def test_raise_exception_valid_conversation_matches() -> None:
    msgs = [CHAT[1], CHAT[2], CHAT[3]]
    expected = _hf(ALTERNATING_TEMPLATE).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert _ours(ALTERNATING_TEMPLATE, msgs) == expected


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([CHAT[1], CHAT[3]], "Conversation roles must alternate"),
        ([{"role": "tool", "content": "x"}], "Conversation roles must alternate"),
        ([CHAT[1], {"role": "system", "content": "x"}], "Only user and assistant roles"),
    ],
)
def test_raise_exception_rejects_bad_roles(messages: list[dict[str, Any]], reason: str) -> None:
    with pytest.raises(jinja2.exceptions.TemplateError, match=reason):
        _hf(ALTERNATING_TEMPLATE).apply_chat_template(messages, tokenize=False)
    with pytest.raises(InvalidRequestError, match=f"chat template rejected the conversation: {reason}"):
        _ours(ALTERNATING_TEMPLATE, messages)


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m['content'] }",  # syntax error
        "{{ messages[0]['content'] + 1 }}",  # type error at render time
        "{{ messages.append(1) }}",  # the sandbox forbids mutation
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox forbids dunder access
        "{% set ns = namespace(_x=1) %}",
    ],
)
def test_broken_template_is_model_format_error(template: str) -> None:
    with pytest.raises(ModelFormatError, match="the chat template in tokenizer_config.json failed"):
        _ours(template, CHAT)


def test_template_source_named_in_error() -> None:
    with pytest.raises(ModelFormatError, match="chat_template.jinja failed"):
        render_chat("{% if %}", CHAT, template_source="chat_template.jinja")


def test_strftime_now_and_extra_variables() -> None:
    year = datetime.now().strftime("%Y")
    out = render_chat("{{ strftime_now('%Y') }}|{{ custom }}|{{ bos_token }}", CHAT, custom="x")
    assert out == f"{year}|x|"  # an unset bos_token renders as nothing, not "None"


def test_list_content_parts_are_flattened() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert _ours(CHATML_TEMPLATE, msgs) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"


def test_assistant_tool_call_without_content_and_none_keys_dropped() -> None:
    msgs = [
        {"role": "user", "content": "weather?", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
    ]
    tpl = "{% for m in messages %}{{ m['role'] }}:{{ 'name' in m }}:{{ 'content' in m }};{% endfor %}"
    assert render_chat(tpl, msgs) == "user:False:True;assistant:False:False;"


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role must be a non-empty string"),
        ([{"role": 3, "content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], r"content\[0\] must be a text part"),
        ([{"role": "user", "content": "x", "meta": object()}], r"messages\[0\]\.meta contains a object"),
    ],
)
def test_invalid_messages(messages: Any, pattern: str) -> None:
    with pytest.raises(InvalidRequestError, match=pattern):
        render_chat(CHATML_TEMPLATE, messages)


def test_reserved_extra_variables() -> None:
    with pytest.raises(InvalidRequestError, match="reserved"):
        render_chat(CHATML_TEMPLATE, CHAT, documents=[])


def test_invalid_tools() -> None:
    with pytest.raises(InvalidRequestError, match="tools must be a list"):
        render_chat(CHATML_TEMPLATE, CHAT, tools="get_weather")  # type: ignore[arg-type]


@pytest.mark.parametrize("template", [None, ""])
def test_no_template(template: str | None) -> None:
    msg = r"model has no chat template; use plain prompt mode \(omit --chat\)"
    with pytest.raises(InvalidRequestError, match=msg):
        require_chat_template(template)
    with pytest.raises(InvalidRequestError, match=msg):
        render_chat(template, CHAT)  # type: ignore[arg-type]


def test_messages_are_not_mutated() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}], "x": None}]
    render_chat(CHATML_TEMPLATE, msgs)
    assert msgs == [{"role": "user", "content": [{"type": "text", "text": "a"}], "x": None}]
