"""Grammars of forced tool calls (issue #34) against the syntax each family's template writes and its parser reads:
a call rendered by the template (or written as the model writes it) is accepted token by token, the parser reads
it back as the same call, and a call that breaks the schema or the syntax is refused."""

from __future__ import annotations

import json

import pytest

from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.text.builtin_templates import DEEPSEEK_V4, DEEPSEEK_V32
from moed.text.chat_template import render_chat
from moed.text.grammar import Grammar, grammar_tokenizer
from moed.text.output_parser import output_parser_for
from moed.text.tokenizer import Tokenizer
from moed.text.tool_grammar import after_reasoning, tool_call_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "units": {"enum": ["c", "f"]}}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {
             "path": {"type": "string"}}, "required": ["path"]}}}]
CALL = {"city": "Paris\nCentre", "days": 2}
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris\\nCentre", "days": 2}}\n</tool_call>'
XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\nCentre\n</parameter>\n<parameter=days>\n2\n"
       "</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _accepts(tokenizer, grammar, text: str) -> bool:
    constraint = grammar_tokenizer(tokenizer, tokenizer.vocab_size, {3}).constraint(grammar)
    for t in tokenizer.encode(text, add_special_tokens=False):
        if constraint.finished or not constraint.mask()[t]:
            return False
        constraint.advance(t)
    return constraint.finished or bool(constraint.mask()[3])  # complete: the end token may come


def _dsml(template: str) -> str:
    """The call block the template writes for an assistant turn with CALL (what the model was trained on)."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": CALL}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prompt = render_chat(template, messages, tools=TOOLS, bos_token="<｜begin▁of▁sentence｜>")
    start = prompt.index("<｜DSML｜", prompt.index("<｜Assistant｜>"))
    return prompt[start:prompt.index("<｜end▁of▁sentence｜>", start)]


GLM47 = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris\nCentre</arg_value><arg_key>days</arg_key>"
         "<arg_value>2</arg_value></tool_call>")
GLM45 = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\nCentre</arg_value>\n<arg_key>days"
         "</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")

# as DeepSeek-V3's (R1's) and V3.1's published chat templates write an assistant turn's call
DS_V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris\\nCentre", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DS_V31 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
          '{"city": "Paris\\nCentre", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
MINIMAX = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris\nCentre</parameter>\n'
           '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>')
MIXTRAL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris\\nCentre", "days": 2}}]'
LLAMA4 = '{"name": "get_weather", "parameters": {"city": "Paris\\nCentre", "days": 2}}'
GEMMA4 = '<|tool_call>call:get_weather{"city": "Paris\\nCentre", "days": 2}<tool_call|>'
KIMI = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Paris\\nCentre", "days": 2}<|tool_call_end|><|tool_calls_section_end|>')

CASES = {
    "glm-4.7 / glm-5": ("glm", {}, GLM47),
    "glm-4.5 newlines, thinking first": ("glm", {}, "<think>hm</think>" + GLM45),
    "generic": ("generic", {}, HERMES),
    "hermes": ("hermes", {}, HERMES),
    "qwen3 JSON, thinking first": ("qwen3", {}, "<think>hm</think>\n\n" + HERMES),
    "qwen3 JSON, prompt opened thinking": ("qwen3", {"reasoning": "open"}, "hm\n</think>\n\n" + HERMES),
    "qwen3-coder XML": ("qwen3", {"xml_calls": True}, XML),
    "dsml V3.2": ("dsml", {"dsml_block": "function_calls", "reasoning": "none"}, _dsml(DEEPSEEK_V32)),
    "dsml V4": ("dsml", {"dsml_block": "tool_calls", "reasoning": "none"}, _dsml(DEEPSEEK_V4)),
    "dsml V4 after thinking": ("dsml", {"dsml_block": "tool_calls", "reasoning": "open"},
                               "ok</think>\n\n" + _dsml(DEEPSEEK_V4)),
    "deepseek V3": ("deepseek", {"reasoning": "none"}, DS_V3),
    "deepseek R1, prompt opened thinking": ("deepseek", {"reasoning": "open"}, "hm</think>\n\n" + DS_V3),
    "deepseek V3.1": ("deepseek", {"deepseek_v31": True, "reasoning": "none"}, DS_V31),
    "mixtral": ("mistral", {}, MIXTRAL),
    "minimax": ("minimax", {"reasoning": "none"}, MINIMAX),
    "llama4": ("llama4", {}, LLAMA4),
    "kimi": ("kimi", {"reasoning": "none"}, KIMI),
    "gemma4 after thinking": ("gemma4", {}, "<|channel>thought\nWeather.<channel|>" + GEMMA4),
    "kimi after thinking": ("kimi", {"reasoning": "open"}, "Weather.</think>" + KIMI),
    "minimax after thinking": ("minimax", {"reasoning": "open"}, "The weather.\n</think>\n\n" + MINIMAX),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_templates_call_is_accepted_and_read_back(tokenizer, case):
    fmt, options, text = CASES[case]
    grammar = tool_call_grammar(fmt, TOOLS, **options)
    assert _accepts(tokenizer, grammar, text), text
    parser = output_parser_for(fmt if fmt != "generic" else "hermes", tools=TOOLS, tool_parameters={
        t["function"]["name"]: t["function"]["parameters"] for t in TOOLS},
                               starts_in_reasoning=options.get("reasoning") == "open")
    parser.feed(text)
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("get_weather", CALL)], case


@pytest.mark.parametrize("case, text", [
    ("hermes", HERMES.replace('"days": 2', '"days": "two"')),
    ("hermes", HERMES.replace("get_weather", "get_time")),
    ("hermes", "Sure! " + HERMES),
    ("qwen3-coder XML", XML.replace("\n2\n", "\ntwo\n")),
    ("qwen3-coder XML", XML.replace("<parameter=city>\nParis\nCentre\n</parameter>\n", "")),  # required city missing
    ("dsml V4", _dsml(DEEPSEEK_V4).replace('string="false">2', 'string="false">"2"')),
    ("glm", GLM47.replace("<arg_value>2<", "<arg_value>2.5<")),
    ("deepseek V3", DS_V3.replace('"days": 2', '"days": "2"')),
    ("deepseek V3", DS_V31),  # V3.1's form where the template writes V3's
    ("deepseek V3.1", DS_V3),
    ("mixtral", MIXTRAL.replace('"get_weather"', '"get_time"')),
    ("mixtral", "Sure. " + MIXTRAL),
    ("llama4", LLAMA4.replace('"parameters"', '"arguments"')),
    ("llama4", "[get_weather(city='Paris', days=2)]"),
    ("kimi", KIMI.replace("functions.get_weather", "functions.get_time")),
    ("kimi", KIMI.replace('"days": 2', '"days": "2"')),
    ("gemma4", GEMMA4.replace('"days": 2', '"days": 2.5')),
    ("minimax", MINIMAX.replace(">2<", ">two<")),
    ("minimax", MINIMAX.replace('<parameter name="city">Paris\nCentre</parameter>\n', "")),  # required city
])
def test_a_call_outside_the_schema_or_syntax_is_refused(tokenizer, case, text):
    fmt, options, _ = {"hermes": CASES["hermes"], "qwen3-coder XML": CASES["qwen3-coder XML"],
                       "dsml V4": CASES["dsml V4"], "glm": CASES["glm-4.7 / glm-5"], "deepseek V3": CASES["deepseek V3"],
                       "deepseek V3.1": CASES["deepseek V3.1"], "mixtral": CASES["mixtral"],
                       "minimax": CASES["minimax"], "llama4": CASES["llama4"], "kimi": CASES["kimi"],
                       "gemma4": CASES["gemma4 after thinking"]}[case]
    assert not _accepts(tokenizer, tool_call_grammar(fmt, TOOLS, **options), text)


HARMONY_NATIVE = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                  'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris\\nCentre", "days": 2}<|call|>')
HARMONY_PLAIN = ('<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris\\nCentre", "days": 2}'
                 '<|call|>')


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory) -> Tokenizer:
    """The tiny tokenizer with harmony's markers as special tokens, as gpt-oss's tokenizer has them."""
    import tokenizers

    from moed.text.tool_grammar import HARMONY_MARKERS

    root = write_tiny_tokenizer(tmp_path_factory.mktemp("harmony"))
    backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    backend.add_special_tokens(list(HARMONY_MARKERS))
    backend.save(str(root / "tokenizer.json"))
    return Tokenizer(root)


@pytest.mark.parametrize("text", [HARMONY_NATIVE, HARMONY_PLAIN], ids=["analysis first, constrain", "call only"])
@pytest.mark.parametrize("specials", [False, True], ids=["markers as text", "markers as special tokens"])
def test_harmony_calls(tokenizer, harmony_tokenizer, text, specials):
    from moed.text.tool_grammar import HARMONY_MARKERS

    tok = harmony_tokenizer if specials else tokenizer
    special = {m: tok.token_to_id(m) for m in HARMONY_MARKERS} if specials else {}
    grammar = tool_call_grammar("harmony", TOOLS, special=special)
    assert _accepts(tok, grammar, text)
    assert not _accepts(tok, grammar, text.replace('"days": 2', '"days": "2"'))
    assert not _accepts(tok, grammar, "<|channel|>final<|message|>It is sunny.<|end|>")
    parser = output_parser_for("harmony", tools=TOOLS)
    parser.feed(text)
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("get_weather", CALL)]


@pytest.fixture(scope="module")
def marker_tokenizer(tmp_path_factory) -> Tokenizer:
    """The tiny tokenizer with DeepSeek-V3's call markers and [TOOL_CALLS] as special tokens, as their tokenizers
    have them."""
    import tokenizers

    from moed.text.tool_grammar import DEEPSEEK_MARKERS, MISTRAL_MARKERS

    root = write_tiny_tokenizer(tmp_path_factory.mktemp("markers"))
    backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    backend.add_special_tokens(list(DEEPSEEK_MARKERS + MISTRAL_MARKERS))
    backend.save(str(root / "tokenizer.json"))
    return Tokenizer(root)


@pytest.mark.parametrize("case", ["deepseek V3", "deepseek V3.1", "mixtral"])
def test_markers_that_are_special_tokens_are_matched_by_id(marker_tokenizer, case):
    from moed.text.tool_grammar import MARKERS

    fmt, options, text = CASES[case]
    special = {m: i for m in MARKERS if (i := marker_tokenizer.token_to_id(m)) is not None}
    assert len(special) == 6
    grammar = tool_call_grammar(fmt, TOOLS, special=special, **options)
    assert _accepts(marker_tokenizer, grammar, text)
    assert not _accepts(marker_tokenizer, grammar, text.replace('"days": 2', '"days": 2.5'))


def test_one_call_when_parallel_calls_are_off_and_formats_without_a_grammar(tokenizer):
    single = tool_call_grammar("hermes", TOOLS, parallel=False)
    assert _accepts(tokenizer, single, HERMES) and not _accepts(tokenizer, single, HERMES + "\n" + HERMES)
    assert _accepts(tokenizer, tool_call_grammar("hermes", TOOLS), HERMES + "\n" + HERMES)
    two_v3 = DS_V3.replace("<｜tool▁calls▁end｜>", "\n" + DS_V3[len("<｜tool▁calls▁begin｜>"):])
    assert _accepts(tokenizer, tool_call_grammar("deepseek", TOOLS, reasoning="none"), two_v3)
    assert not _accepts(tokenizer, tool_call_grammar("deepseek", TOOLS, reasoning="none", parallel=False), two_v3)
    two_mixtral = MIXTRAL[:-1] + ", " + MIXTRAL[len("[TOOL_CALLS] ["):]
    assert _accepts(tokenizer, tool_call_grammar("mistral", TOOLS), two_mixtral)
    assert not _accepts(tokenizer, tool_call_grammar("mistral", TOOLS, parallel=False), two_mixtral)
    assert _accepts(tokenizer, tool_call_grammar("llama4", TOOLS), LLAMA4 + "; " + LLAMA4)
    assert not _accepts(tokenizer, tool_call_grammar("llama4", TOOLS, parallel=False), LLAMA4 + "; " + LLAMA4)
    assert tool_call_grammar("plain", TOOLS) is None


def test_a_json_answer_after_the_reasoning_block(tokenizer):
    """response_format on a model that reasons in <think> tags: the reasoning stays free, the schema holds after it;
    a model whose template closed the block (thinking off) answers JSON at once; other grammars are unchanged."""
    schema = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                  "additionalProperties": False})
    tags = ("<think>", "</think>")
    opened = after_reasoning(schema, tags, "open")
    assert _accepts(tokenizer, opened, 'first {"a": "x"} maybe</think>\n\n{"a": 12}')
    assert not _accepts(tokenizer, opened, 'done</think>\n\n{"a": "12"}')
    optional = after_reasoning(schema, tags, "optional")
    assert _accepts(tokenizer, optional, '<think>hm</think>{"a": 1}') and _accepts(tokenizer, optional, '{"a": 1}')
    assert after_reasoning(schema, tags, "none") is schema
    regex = Grammar("regex", "[a-z]+")
    assert after_reasoning(regex, tags, "open") is regex
