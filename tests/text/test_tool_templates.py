"""Tools through chat templates: Tokenizer.apply_chat_template(tools=...) and has_native_tools."""

from __future__ import annotations

import json

import pytest
from helpers.tiny_tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer
from helpers.tool_templates import (GPT_OSS_TOOL_TEMPLATE, QWEN3_TOOL_TEMPLATE, TIME_TOOL, WEATHER_TOOL,
                                    install_tool_template)
from transformers import PreTrainedTokenizerFast

from moed.text.chat_template import template_renders_tools
from moed.text.output_parser import output_parser_for, has_native_tools
from moed.text.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


@pytest.fixture(params=[QWEN3_TOOL_TEMPLATE, GPT_OSS_TOOL_TEMPLATE], ids=["qwen3", "gpt_oss"])
def tool_model_dir(request, tmp_path):
    write_tiny_tokenizer(tmp_path)
    install_tool_template(tmp_path, request.param)
    return tmp_path, request.param


def test_tokenizer_renders_tools_like_transformers(tool_model_dir):
    model_dir, template = tool_model_dir
    ours = Tokenizer(model_dir)
    theirs = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tools = [WEATHER_TOOL, TIME_TOOL]
    for messages in (CONVERSATION[:2], CONVERSATION):
        expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tools=tools) == expected
        assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
    prompt = ours.apply_chat_template(CONVERSATION, tools=tools)
    assert "get_weather" in prompt and "get_time" in prompt and "14:05" in prompt
    assert "get_weather" not in ours.apply_chat_template(CONVERSATION[:2])
    if template is QWEN3_TOOL_TEMPLATE:
        assert "<tools>\n" + json.dumps(WEATHER_TOOL) in prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
        assert '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}' in prompt
        assert prompt.count("<tool_response>") == 2 and prompt.count("<|im_start|>user") == 2  # one user turn


def test_has_native_tools_tells_tool_templates_from_plain_chatml(tool_model_dir):
    model_dir, template = tool_model_dir
    tokenizer = Tokenizer(model_dir)
    family = "qwen3" if template is QWEN3_TOOL_TEMPLATE else "harmony"  # the families' output formats
    assert tokenizer.tool_chat_template == template
    assert has_native_tools(family, tokenizer.tool_chat_template)
    assert not has_native_tools("plain", template)  # no tool syntax in the format (OLMoE's)
    assert not has_native_tools(family, CHATML_TEMPLATE)  # the template ignores tools
    assert not has_native_tools(family, None)


def test_template_renders_tools_edge_cases(tmp_path):
    write_tiny_tokenizer(tmp_path)
    assert not template_renders_tools(Tokenizer(tmp_path).tool_chat_template)  # the tiny ChatML one
    assert not template_renders_tools("{{ raise_exception('no') }}")
    assert not template_renders_tools("{% for %}")  # broken template: not a crash
    # needs a system message first, and mentions tools only then
    picky = ("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
             "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}")
    assert template_renders_tools(picky)


def test_tool_use_template_is_preferred(tmp_path):
    write_tiny_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "default", "template": CHATML_TEMPLATE},
                            {"name": "tool_use", "template": QWEN3_TOOL_TEMPLATE}]
    cfg_path.write_text(json.dumps(cfg))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.tool_chat_template == QWEN3_TOOL_TEMPLATE and has_native_tools("qwen3",
                                                                                   tokenizer.tool_chat_template)
    assert "<tools>" in tokenizer.apply_chat_template(CONVERSATION[:2], tools=[WEATHER_TOOL])


def test_model_output_through_the_stream_decoder(tmp_path):
    """Token-by-token deltas of the tiny tokenizer (special tokens kept) parse like the whole text."""
    write_tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    output = ('<think>\nCall it.\n</think>\n\nOn it: café ✓\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Zürich 日本"}}\n</tool_call><|im_end|>')
    ids = tokenizer.encode(output, add_special_tokens=False)
    decoder = tokenizer.stream_decoder(skip_special_tokens=False)
    parser = output_parser_for("qwen3", tools=True)
    events = []
    for token_id in ids:
        events += parser.feed(decoder.add(token_id))
    events += parser.feed(decoder.flush()) + parser.finish()
    assert "".join(e.text for e in events if e.kind == "text") == "On it: café ✓\n"
    assert "".join(e.text for e in events if e.kind == "reasoning") == "Call it.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("get_weather", {"city": "Zürich 日本"})]
