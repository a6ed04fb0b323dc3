"""moed's chat templates for DeepSeek-V3.2 and V4 (their checkpoints ship a Python encoder and no template):
DeepSeek's published example prompts, prompts DeepSeek-V4's encoder (``encoding/encoding_dsv4.py``) produced for
agent conversations (tests/data/deepseek_v4_encoder_prompts.json), tool turns the DSML parser reads back, and
their use only where a checkpoint has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.engine.runtime import open_runtime
from moed.text.builtin_templates import DEEPSEEK_V4, DEEPSEEK_V32, builtin_template
from moed.text.chat_template import render_chat, template_renders_tools
from moed.text.output_parser import has_native_tools, output_parser_for

V4_PROMPTS = json.loads((Path(__file__).parent.parent / "data" / "deepseek_v4_encoder_prompts.json").read_text())
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def test_deepseeks_published_thinking_example():
    """The example in DeepSeek-V3.2's README (encode_messages with thinking_mode="thinking")."""
    messages = [{"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
                {"role": "user", "content": "1+1=?"}]
    assert render_chat(DEEPSEEK_V32, messages, enable_thinking=True, bos_token=BOS) == (
        BOS + "<｜User｜>hello<｜Assistant｜></think>Hello! I am DeepSeek." + EOS
        + "<｜User｜>1+1=?<｜Assistant｜><think>")


def test_chat_mode_closes_thinking_after_every_user_turn_and_drops_reasoning():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
                {"role": "user", "content": "bye"}]
    for variables in ({}, {"enable_thinking": False}, {"thinking": False}):
        assert render_chat(DEEPSEEK_V32, messages, bos_token=BOS, **variables) == (
            BOS + "Be brief.<｜User｜>hi<｜Assistant｜></think>Hello." + EOS + "<｜User｜>bye<｜Assistant｜></think>")


def test_a_tool_turn_renders_as_the_model_writes_it_and_results_reopen_thinking():
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "need the tool", "tool_calls": [call]},
                {"role": "tool", "content": "sunny"}]
    prompt = render_chat(DEEPSEEK_V32, messages, tools=TOOLS, enable_thinking=True, bos_token=BOS)
    assert prompt.startswith(BOS + "## Tools\n\n") and json.dumps(TOOLS[0]["function"]) in prompt
    head, turn = prompt.split("<｜User｜>Weather?<｜Assistant｜><think>")
    assert turn == ("need the tool</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
                    "<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                    "</｜DSML｜function_calls>" + EOS + "\n\n<function_results>\n<result>sunny</result>\n"
                    "</function_results>\n\n<think>")
    # what the template writes for a call, the family's parser reads back as the same call
    written = turn[len("need the tool</think>"):turn.index(EOS)]
    parser = output_parser_for("dsml", tools=True)
    parser.feed(written)
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                                "days": 2})]
    assert template_renders_tools(DEEPSEEK_V32) and has_native_tools("dsml", DEEPSEEK_V32)


@pytest.mark.parametrize("own_template", [False, True])
def test_a_deepseek_v32_checkpoint_without_a_template_gets_moeds(tmp_path, own_template):
    build_tiny_model("deepseek_v32", tmp_path)
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if not own_template:
        config.pop("chat_template", None)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = open_runtime(tmp_path).tokenizer
    if own_template:
        assert tokenizer.chat_template == config["chat_template"]  # the checkpoint's own always wins
    else:
        assert tokenizer.chat_template == DEEPSEEK_V32 and "moed's DeepSeek-V3.2" in tokenizer.chat_template_source
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert prompt.endswith("<｜User｜>hi<｜Assistant｜></think>")
    assert builtin_template("qwen3_moe") is None


def _as_moed_passes_them(messages: list[dict]) -> list[dict]:
    """The API layer hands templates a tool call's arguments as an object (the encoder takes the JSON text)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.mark.parametrize("case", V4_PROMPTS, ids=[c["name"] for c in V4_PROMPTS])
def test_deepseek_v4_renders_what_its_encoder_does(case):
    """Each prompt was produced by DeepSeek-V4's own encoder (the first two are DeepSeek's published examples; the
    request's tools given to it on the system message, an empty one when the conversation has none)."""
    variables = {"enable_thinking": case["enable_thinking"]}
    if case["reasoning_effort"]:
        variables["reasoning_effort"] = case["reasoning_effort"]
    got = render_chat(DEEPSEEK_V4, _as_moed_passes_them(case["messages"]), tools=case["tools"], bos_token=BOS,
                      **variables)
    assert got == case["prompt"]


def test_deepseek_v4_tool_calls_read_back_and_the_family_uses_the_template():
    """What V4's template writes for a call, the DSML parser reads back as the same call; the family names the
    template, so a V4 checkpoint without one gets it."""
    from moed.models.families import FAMILIES

    case = next(c for c in V4_PROMPTS if c["name"].startswith("chat agent turn"))
    prompt = case["prompt"]
    written = prompt[prompt.index("<｜DSML｜tool_calls>"):prompt.index(EOS, prompt.index("<｜DSML｜tool_calls>"))]
    parser = output_parser_for("dsml", tools=True)
    parser.feed(written)
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("search", {"query": "Paris news", "filters": {"lang": ["fr", "en"], "recent": True}})]
    assert template_renders_tools(DEEPSEEK_V4) and has_native_tools("dsml", DEEPSEEK_V4)
    assert builtin_template(FAMILIES["deepseek_v4"].chat_template)[0] == DEEPSEEK_V4
