"""Forced tool calls (issue #34): ``tool_choice`` "required" / a named function (OpenAI Chat and Responses) and
``{"type": "any"}`` / ``{"type": "tool"}`` (Anthropic) make a tiny random model, which never calls a tool by
itself, answer with calls whose arguments parse as JSON of the tool's schema, 20 times of 20, sampled at
temperature 1: in moed's generic format (a template without tool syntax) and in each family's own syntax (Qwen's
Hermes JSON, Qwen3-Coder's XML, DeepSeek's DSML and V3 call tokens, Mixtral's [TOOL_CALLS], GLM's, MiniMax-M2's
XML invokes, Llama-4's JSON calls, Kimi's call sections, Gemma-4's calls), read back by
the usual parsers.
"""

from __future__ import annotations

import json

import openai
import pytest

from helpers.http_daemon import start_http_daemon
from helpers.tiny_models import build_tiny_model, tiny_config
from helpers.tiny_tokenizer import write_tiny_tokenizer
from helpers.tool_templates import install_tool_template
from moed.engine.model_manager import LoadOptions

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
READ = {"type": "object", "properties": {"path": {"enum": ["README.md", "src/main.py"]}}, "required": ["path"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": READ}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Qwen3's template closes the reasoning block without thinking; with it a random model would "think" forever
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ROUNDS = 20
# Qwen3-Coder's call syntax (XML body), reduced to what matters here; thinking closed as Qwen3's templates do
CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for t in tools %}{{ t.function | tojson }}\n{%- endfor %}"
    "Call a tool with <tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{%- endif %}")
# DeepSeek-V3's call tokens (V3 form: its template shows the ```json fence), thinking closed as V3.1's
# non-thinking prompt does
DSV3_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}## Tools\n{%- for t in tools %}{{ t.function | tojson }}\n{%- endfor %}"
    "Call: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```"
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}<｜User｜>{{ m.content }}{%- else %}<｜Assistant｜>"
    "{{ m.content }}<｜end▁of▁sentence｜>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜></think>{%- endif %}")
# Mixtral-8x22B's tools block, reduced
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]{%- else %}{{ m.content }}"
    "{{ eos_token }}{%- endif %}{%- endfor %}")
# MiniMax-M2's markers, reduced; its prompt opens <think>: closed here, or a random model would think forever
MINIMAX_TEMPLATE = (
    "]~!b[]~b]system\n{%- if tools %}# Tools\n<tools>\n{%- for t in tools %}<tool>{{ t.function | tojson }}</tool>\n"
    "{%- endfor %}</tools>\nWhen making tool calls, use XML format:\n<minimax:tool_call>\n<invoke name=\"tool-name\">\n"
    "<parameter name=\"param-key\">param-value</parameter>\n</invoke>\n</minimax:tool_call>{%- endif %}[e~[\n"
    "{%- for m in messages %}]~b]{{ 'ai' if m.role == 'assistant' else m.role }}\n{{ m.content }}[e~[\n{%- endfor %}"
    "{%- if add_generation_prompt %}]~b]ai\n<think>\n\n</think>\n\n{%- endif %}")
# Llama-4's header tokens and its template's JSON call instruction, reduced
LLAMA4_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}<|header_start|>system<|header_end|>\n\nRespond with a JSON function call "
    "{\"name\": function name, \"parameters\": arguments}.\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}<|eot|>"
    "{%- endif %}{%- for m in messages %}<|header_start|>{{ m.role }}<|header_end|>\n\n{{ m.content }}<|eot|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{%- endif %}")
# Kimi's role tokens, reduced; thinking closed (Kimi-K2-Thinking's <think>), or a random model would think forever
KIMI_TEMPLATE = (
    "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif %}"
    "{%- for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|><think></think>{%- endif %}")
# Gemma-4's turns and tool declarations, reduced; its thought channel closed
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{%- if tools %}<|turn>system\n{%- for t in tools %}<|tool>declaration:{{ t.function.name }}"
    "{{ t.function | tojson }}<tool|>{%- endfor %}<turn|>\n{%- endif %}{%- for m in messages %}<|turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<turn|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|turn>model\n<|channel>thought\n<channel|>{%- endif %}")
NATIVE = ["qwen", "coder", "dsv32", "dsv3", "mixtral", "glm", "minimax", "llama4", "kimi", "gemma4"]


def _valid(name: str, arguments: dict) -> bool:
    if name == "get_weather":
        return (set(arguments) == {"city", "days"} and isinstance(arguments["city"], str)
                and len(arguments["city"]) <= 12 and type(arguments["days"]) is int and 1 <= arguments["days"] <= 7)
    return name == "read_file" and arguments == {"path": arguments.get("path")} and arguments["path"] in (
        "README.md", "src/main.py")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, family in (("tiny", "mixtral"), ("qwen", "qwen3_moe"), ("coder", "qwen3_moe"), ("dsv32", "deepseek_v32"),
                         ("dsv3", "deepseek_v3"), ("mixtral", "mixtral"), ("glm", "glm4_moe"),
                         ("minimax", "minimax_m2"), ("llama4", "llama4_text"), ("kimi", "kimi_linear"),
                         ("gemma4", "gemma4_text")):
        # "tiny": no tool syntax -> generic format
        config = tiny_config(family)
        config.max_position_embeddings = 2048  # the tools' system prompt alone is ~800 tokens of the tiny vocab
        build_tiny_model(family, root / name, config=config)
        write_tiny_tokenizer(root / name)
    install_tool_template(root / "qwen")  # Qwen3's Hermes-style tools template
    install_tool_template(root / "glm")  # it renders the tools; the GLM family writes (and is held to) GLM's calls
    install_tool_template(root / "coder", CODER_TEMPLATE)
    install_tool_template(root / "dsv3", DSV3_TEMPLATE)
    install_tool_template(root / "mixtral", MIXTRAL_TEMPLATE)
    install_tool_template(root / "minimax", MINIMAX_TEMPLATE)
    install_tool_template(root / "llama4", LLAMA4_TEMPLATE)
    install_tool_template(root / "kimi", KIMI_TEMPLATE)
    install_tool_template(root / "gemma4", GEMMA4_TEMPLATE)
    config_path = root / "dsv32" / "tokenizer_config.json"  # no template of its own: moed's DeepSeek-V3.2 one
    config_path.write_text(json.dumps({k: v for k, v in json.loads(config_path.read_text()).items()
                                       if k != "chat_template"}))
    d = start_http_daemon(root, models=("tiny", *NATIVE),
                          options=LoadOptions(device="cpu", max_batch=4, context_length=2048))
    yield d
    d.close()


@pytest.fixture(scope="module")
def client(daemon):
    return daemon.openai()


@pytest.mark.parametrize("model", ["tiny", *NATIVE])
def test_required_gives_schema_valid_calls_twenty_times_of_twenty(client, model):
    names = set()
    for seed in range(ROUNDS):
        done = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=1.0, seed=seed, max_tokens=300, parallel_tool_calls=False,
                                              extra_body=NO_THINKING)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            assert _valid(call.function.name, json.loads(call.function.arguments)), call
            names.add(call.function.name)
    assert names == {"get_weather", "read_file"}  # the model still chooses which tool


def test_without_a_forced_choice_the_random_model_calls_nothing(client):
    """The control: tool_choice "auto" leaves the random model to write text."""
    for seed in range(3):
        done = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                              max_tokens=30)
        assert not done.choices[0].message.tool_calls


@pytest.mark.parametrize("model", ["tiny", "qwen"])
def test_a_named_function_without_parallel_calls_is_exactly_one_call_of_it(client, model):
    for seed in range(5):
        done = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=300,
            tool_choice={"type": "function", "function": {"name": "read_file"}}, parallel_tool_calls=False,
            extra_body=NO_THINKING)
        calls = done.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "read_file", calls
        assert _valid("read_file", json.loads(calls[0].function.arguments))


def test_streamed_forced_calls_parse(client):
    stream = client.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=11, max_tokens=300, stream=True,
                                            extra_body=NO_THINKING)
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    # parallel calls allowed: a random model may go on calling until max_tokens (a real one ends its turn)
    assert reason in ("tool_calls", "length") and calls
    assert all(_valid(c["name"], json.loads(c["arguments"])) for c in list(calls.values())[:-1])


def test_responses_required(client):
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    for seed in range(ROUNDS):
        done = client.responses.create(model="qwen", input="Weather in Paris?", tools=tools, tool_choice="required",
                                       temperature=1.0, max_output_tokens=300, parallel_tool_calls=False,
                                       reasoning={"effort": "none"}, extra_body={"seed": seed})
        calls = [item for item in done.output if item.type == "function_call"]
        assert calls and all(_valid(c.name, json.loads(c.arguments)) for c in calls), done.output


@pytest.mark.parametrize("model", ["tiny", "qwen"])
def test_anthropic_any_and_named_tool(daemon, model):
    client = daemon.anthropic()
    tools = [{"name": t["function"]["name"], "description": "x", "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    for seed in range(ROUNDS):
        done = client.messages.create(model=model, max_tokens=300, messages=ASK, tools=tools,
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                      thinking={"type": "disabled"}, extra_body={"temperature": 1.0})
        uses = [b for b in done.content if b.type == "tool_use"]
        assert done.stop_reason == "tool_use" and uses, done.content
        assert all(_valid(u.name, u.input) for u in uses)
    done = client.messages.create(model=model, max_tokens=300, messages=ASK, tools=tools,
                                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                  thinking={"type": "disabled"})
    uses = [b for b in done.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and _valid("get_weather", uses[0].input)


def test_a_forced_choice_with_a_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8,
                                       response_format={"type": "json_object"})
    assert err.value.body.get("param") == "tool_choice"
