"""Tool calls end to end through the OpenAI APIs: a scripted "model" behind a Qwen3-style tools template.

The model's answers are written here (a tool call when tools are in the prompt, a sentence once a
tool result is): what is tested is the gateway, template rendering and parsing, with the SDK.
"""

from __future__ import annotations

import json

import openai
import pytest

from helpers.http_daemon import ChatScriptedModel, add_scripted_model, start_http_daemon, tools_tokenizer
from helpers.tiny_tokenizer import CHATML_TEMPLATE
from helpers.tool_templates import QWEN3_TOOL_TEMPLATE

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SUNNY = "It is sunny in Paris."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Qwen3-MoE's own template slices every message's content (its backwards scan for the last real user
# query), so a message that reaches it without content fails to render
QWEN3_SCANNING_TEMPLATE = ("{%- for message in messages[::-1] %}{%- set head = message.content[:15] %}{%- endfor %}"
                           + QWEN3_TOOL_TEMPLATE)
# Qwen3-Coder (a qwen3_moe checkpoint) writes calls as XML with raw values; the tool's schema types them
CODER_CALL = ("<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
              "<parameter=limit>\n40\n</parameter>\n<parameter=follow>\ntrue\n</parameter>\n</function>\n"
              "</tool_call>")
# gpt-oss's template shows the reasoning of a tool-call turn (its analysis message) from the message's
# "thinking" field, and refuses a tool-call turn that has both content and thinking
THINKING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- if m.content and m.thinking %}{{ raise_exception('Cannot pass both content and thinking') }}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if m.thinking %}{{- 'analysis: ' + m.thinking + '\\n' }}{%- endif %}"
    "{%- if m.content %}{{- 'analysis: ' + m.content + '\\n' }}{%- endif %}"
    "{%- for c in m.tool_calls %}{{- 'call ' + c.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
READ_TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"},
                                     "follow": {"type": "boolean"}}, "required": ["path"]}}}


# the model ends its turn in the middle of a call's arguments
CUT_CALL = 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'

# GLM-5's and DeepSeek-V3.2's own call syntax, as their templates render a call (reasoning first)
GLM_CALL = ("<think>Read it first.</think>Reading.<tool_call>read_file<arg_key>path</arg_key><arg_value>src/main.py"
            "</arg_value><arg_key>limit</arg_key><arg_value>40</arg_value><arg_key>follow</arg_key>"
            "<arg_value>true</arg_value></tool_call>")
DSML_CALL = ("<think>Read it first.</think>Reading.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"read_file\">\n"
             "<｜DSML｜parameter name=\"path\" string=\"true\">src/main.py</｜DSML｜parameter>\n"
             "<｜DSML｜parameter name=\"limit\" string=\"false\">40</｜DSML｜parameter>\n"
             "<｜DSML｜parameter name=\"follow\" string=\"false\">true</｜DSML｜parameter>\n"
             "</｜DSML｜invoke>\n</｜DSML｜function_calls>")

# Nemotron-3-Nano: Qwen3-Coder's XML calls after its reasoning (its template opens <think>; closed here)
NEMOTRON_CALL = "<think>Read it first.</think>Reading.\n" + CODER_CALL
# Gemma-4: its thought channel and its call syntax (unquoted keys, <|"|> strings), then the token it writes after calls
GEMMA4_CALL = ('<|channel>thought\nRead it first.<channel|>Reading.<|tool_call>call:read_file{path:<|"|>src/main.py<|"|>,'
               'limit:40,follow:true}<tool_call|><|tool_response>')
# Kimi-Linear / Kimi-K2: Moonshot's call section after the reasoning
KIMI_CALL = ("<think>Read it first.</think>Reading.<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0"
             '<|tool_call_argument_begin|>{"path": "src/main.py", "limit": 40, "follow": true}<|tool_call_end|>'
             "<|tool_calls_section_end|>")
# Llama-4: its template's JSON call object, and Meta's pythonic form
LLAMA4_CALLS = {"llama4": '{"name": "read_file", "parameters": {"path": "src/main.py", "limit": 40, "follow": true}}',
                "llama4-py": '[read_file(path="src/main.py", limit=40, follow=True)]'}


def answer(prompt: str) -> str:
    if "Cut short" in prompt:
        return CUT_CALL
    if "<tool_response>\n" in prompt:  # a result (the generic format's instructions name the tag too)
        return SUNNY
    if "# Tools" in prompt:
        return CALL
    return "Hello there."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_http_daemon()
    model = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("tok"), QWEN3_SCANNING_TEMPLATE), answer)
    add_scripted_model(d, "qwen", model)
    plain = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("plain"), CHATML_TEMPLATE), answer,
                              family="mixtral")
    add_scripted_model(d, "no-tools", plain)
    d.plain = plain
    add_scripted_model(d, "coder", ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("coder")),
                                                     lambda prompt: CODER_CALL))
    # Qwen3.6-35B-A3B (qwen3_5_moe) writes Qwen3-Coder's XML calls too; Qwen3-Next Hermes JSON
    d.qwen36 = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("qwen36")), lambda prompt: CODER_CALL,
                                 family="qwen3_5_moe")
    add_scripted_model(d, "qwen36", d.qwen36)
    for name, family, output in (("glm5", "glm_moe_dsa", GLM_CALL), ("dsv32", "deepseek_v32", DSML_CALL),
                                 ("nemotron", "nemotron_h", NEMOTRON_CALL), ("gemma4", "gemma4_text", GEMMA4_CALL),
                                 ("kimi", "kimi_linear", KIMI_CALL),
                                 *((name, "llama4_text", out) for name, out in LLAMA4_CALLS.items())):
        add_scripted_model(d, name, ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp(name)),
                                                      lambda prompt, output=output: output, family=family))
    d.thinker = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("thinker"), THINKING_TEMPLATE), answer)
    add_scripted_model(d, "thinker", d.thinker)
    d.model = model
    yield d
    d.close()


def test_a_tool_call_is_parsed_into_message_tool_calls(daemon, client):
    reply = client.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id
    prompt = daemon.model.prompts[-1]
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt  # the template rendered the tool
    assert reply.usage.completion_tokens == len(daemon.model.tokenizer.encode(CALL, add_special_tokens=False)) + 1


def test_streamed_tool_call_deltas_build_the_same_call(client):
    chunks = list(client.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS, temperature=0,
                                                 stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.index == 0 for d in deltas)
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


@pytest.mark.parametrize("model", ["coder", "qwen36"])
def test_xml_call_values_are_typed_by_the_tool_schema(daemon, client, model):
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[READ_TOOL])
    if model == "qwen36":  # Qwen3.5/3.6's own template renders the tools (Qwen3's format), not moed's generic one
        assert "<tools>" in daemon.qwen36.prompts[-1] and "You can call the tools below" not in daemon.qwen36.prompts[-1]
    [call] = reply.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"path": "src/main.py", "limit": 40, "follow": True}
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[READ_TOOL], stream=True))
    streamed = "".join(tc.function.arguments or "" for c in chunks if c.choices
                       for tc in c.choices[0].delta.tool_calls or [])
    assert json.loads(streamed) == {"path": "src/main.py", "limit": 40, "follow": True}


def test_a_whole_answer_keeps_a_call_cut_short_as_text(daemon, client):
    """Without a stream nothing of a call goes out before it is complete, so a broken one stays text."""
    cut = [{"role": "user", "content": "Cut short"}]
    reply = client.chat.completions.create(model="qwen", messages=cut, tools=TOOLS)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == CUT_CALL
    response = client.responses.create(model="qwen", input="Cut short", tools=RESPONSES_TOOLS)
    assert [o.type for o in response.output] == ["message"] and response.output_text == CUT_CALL
    message = daemon.anthropic().messages.create(model="qwen", max_tokens=200, messages=cut, tools=[
        {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}])
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == CUT_CALL
    assert message.stop_reason == "end_turn"


def test_the_tool_result_round_trip_renders_the_call_and_the_result(daemon, client):
    first = client.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow_up = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    reply = client.chat.completions.create(model="qwen", messages=follow_up, tools=TOOLS, temperature=0)
    assert reply.choices[0].message.content == SUNNY
    assert reply.choices[0].finish_reason == "stop"
    prompt = daemon.model.prompts[-1]
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt


def test_tool_choice_none_renders_no_tools(daemon, client):
    reply = client.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].message.content == "Hello there."
    assert reply.choices[0].message.tool_calls is None
    assert "<tools>" not in daemon.model.prompts[-1]


def test_a_named_tool_choice_must_name_a_given_tool(client):
    reply = client.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "send_mail"}})
    assert "send_mail" in err.value.body["message"] and err.value.body["param"] == "tool_choice"


def test_a_model_whose_template_has_no_tool_syntax_gets_the_generic_tool_format(daemon, client):
    """A chatml template that renders only role and content (family mixtral, whose own syntax is
    [TOOL_CALLS]): the tools go into the system prompt, the call comes back as <tool_call> JSON, and the
    next turn shows the call and its result as text."""
    reply = client.chat.completions.create(model="no-tools", messages=ASK, tools=TOOLS, temperature=0)
    prompt = daemon.plain.prompts[-1]
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in prompt
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    history = ASK + [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp_c": 21}'}]
    second = client.chat.completions.create(model="no-tools", messages=history, tools=TOOLS, temperature=0)
    assert second.choices[0].message.content == SUNNY
    prompt = daemon.plain.prompts[-1]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>') in prompt
    # without tools the same model answers, and the earlier call is still shown as text
    again = client.chat.completions.create(model="no-tools", messages=history)
    assert again.choices[0].message.content == SUNNY and "# Tools" not in daemon.plain.prompts[-1]


def test_a_tool_result_without_its_call_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="qwen", tools=TOOLS, messages=ASK + [
            {"role": "tool", "tool_call_id": "call_missing", "content": "21"}])
    assert "call_missing" in err.value.body["message"]


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
                    "parameters": TOOLS[0]["function"]["parameters"]}]


def test_responses_function_call_round_trip(daemon, client):
    first = client.responses.create(model="qwen", input="What is the weather in Paris?", tools=RESPONSES_TOOLS)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.status == "completed"
    second = client.responses.create(model="qwen", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert second.output_text == SUNNY
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in daemon.model.prompts[-1]


def test_the_reasoning_of_a_tool_call_turn_reaches_templates_that_read_thinking(daemon, client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "I need the weather first."}]}
    client.responses.create(model="thinker", input=[ASK[0], reasoning, call, output])
    assert "analysis: I need the weather first.\ncall get_weather" in daemon.thinker.prompts[-1]
    # with text in the turn too, the reasoning stays out of "thinking" (such templates refuse both)
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}
    client.responses.create(model="thinker", input=[ASK[0], reasoning, said, call, output])
    assert "analysis: Checking.\ncall get_weather" in daemon.thinker.prompts[-1]
    client.chat.completions.create(model="thinker", messages=ASK + [
        {"role": "assistant", "content": None, "reasoning_content": "I need the weather first.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}])
    assert "analysis: I need the weather first.\ncall get_weather" in daemon.thinker.prompts[-1]


def test_responses_stream_with_a_function_call(client):
    events = list(client.responses.create(model="qwen", input="What is the weather in Paris?",
                                          tools=RESPONSES_TOOLS, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed"
    assert "response.function_call_arguments.done" in types and "response.output_item.done" in types
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == {"city": "Paris"}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].name == "get_weather"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_call_output_without_its_call_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="qwen", input=[
            {"role": "user", "content": "hi"},
            {"type": "function_call_output", "call_id": "call_x", "output": "21"}])
    assert "call_x" in err.value.body["message"]


@pytest.mark.parametrize("model", ["glm5", "dsv32", "nemotron", "gemma4", "kimi", *sorted(LLAMA4_CALLS)])
def test_each_familys_own_calls_reach_both_apis_whole_and_streamed(daemon, client, model):
    """GLM-5's, DeepSeek-V3.2's, Nemotron-3's, Gemma-4's, Kimi's (reasoning first) and Llama-4's (JSON and pythonic,
    no reasoning) calls as their models write them."""
    thinks = not model.startswith("llama4")
    want = {"path": "src/main.py", "limit": 40, "follow": True}
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[READ_TOOL])
    choice = reply.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "read_file"
    assert json.loads(call.function.arguments) == want
    if thinks:
        assert choice.message.content.strip() == "Reading." and "Read it first." in str(choice.message.model_extra)
    else:
        assert not choice.message.content
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[READ_TOOL], stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "read_file"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == want
    message = daemon.anthropic().messages.create(model=model, max_tokens=1000, messages=ASK, tools=[{
        "name": "read_file", "description": "Read a file", "input_schema": READ_TOOL["function"]["parameters"]}])
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and use.name == "read_file" and use.input == want
    assert [b.thinking for b in message.content if b.type == "thinking"] == (["Read it first."] if thinks else [])

