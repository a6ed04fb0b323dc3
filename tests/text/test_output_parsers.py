"""Output parsers per tool-call format: realistic outputs in any delta split give the same text, reasoning and calls."""

from __future__ import annotations

import json
import random
import re

import pytest

from moed.text.output_parser import (
    TOOL_FORMATS,
    OutputEvent,
    output_parser_for,
    prompt_opens_reasoning,
)
from moed.text.output_parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, EOS, SEP

WEATHER_ARGS = {"city": "Paris", "unit": "celsius"}
TIME_ARGS = {"tz": "Europe/Paris", "nested": {"list": [1, 2.5, -3e2, True, None], "s": "a \"quoted\" } ] <tag>"}}

# Every marker each format uses: none may ever show up in text of a well-formed output.
MARKERS = {
    "qwen3": ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_end|>"],
    "hermes": ["<tool_call>", "</tool_call>", "<|im_end|>"],
    "harmony": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>",
                "to=functions"],
    "deepseek": [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, EOS, "<think>", "</think>", "```json"],
    "mistral": ["[TOOL_CALLS]", "</s>"],
    "llama4": ["<|python_start|>", "<|python_end|>", "<|eot|>", "<|eom|>"],
    "kimi": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
             "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_end|>", "<think>", "</think>"],
}


def hermes_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# family, options, output, expected (text, reasoning, [(name, args)])
CASES = [
    ("qwen3", {},
     "<think>\nThe user wants the weather and the time. I'll call both tools.\n</think>\n\n"
     "Let me check both for you.\n" + hermes_call("get_weather", WEATHER_ARGS) + "\n"
     + hermes_call("get_time", TIME_ARGS) + "<|im_end|>",
     ("Let me check both for you.\n", "The user wants the weather and the time. I'll call both tools.\n",
      [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])),
    ("qwen3", {"starts_in_reasoning": True},
     "Paris weather: a tool call is needed.\n</think>\n\n" + hermes_call("get_weather", WEATHER_ARGS),
     ("", "Paris weather: a tool call is needed.\n", [("get_weather", WEATHER_ARGS)])),
    ("qwen3", {},
     "<think>\n</think>\n\nThe answer is `a < b` and <b>bold</b>; 3 <tool 4.",
     ("The answer is `a < b` and <b>bold</b>; 3 <tool 4.", "", [])),
    ("hermes", {},
     "Sure, checking.\n" + hermes_call("get_weather", WEATHER_ARGS) + "\nDone? <think>not a tag here</think>",
     ("Sure, checking.\nDone? <think>not a tag here</think>", "", [("get_weather", WEATHER_ARGS)])),
    ("harmony", {},
     "<|channel|>analysis<|message|>User asks for weather in Paris. Use get_weather.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking the weather and the time.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     + json.dumps(WEATHER_ARGS) + "<|call|>",
     ("Checking the weather and the time.", "User asks for weather in Paris. Use get_weather.",
      [("get_weather", WEATHER_ARGS)])),
    ("harmony", {},  # to= in the role part, content type without <|constrain|>, stop token left out
     "<|channel|>analysis<|message|>Need the time too.<|end|>"
     "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>" + json.dumps(TIME_ARGS),
     ("", "Need the time too.", [("get_time", TIME_ARGS)])),
    ("harmony", {},
     "<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant<|channel|>final<|message|>"
     "2 + 2 = 4. In code: `x <| y` and `<|notatoken|>`.<|return|>",
     ("2 + 2 = 4. In code: `x <| y` and `<|notatoken|>`.", "Simple arithmetic.", [])),
    ("deepseek", {"starts_in_reasoning": True},
     "The user needs two lookups.\n</think>\n\nI'll look both up." + CALLS_BEGIN
     + CALL_BEGIN + "function" + SEP + "get_weather\n```json\n" + json.dumps(WEATHER_ARGS) + "\n```" + CALL_END + "\n"
     + CALL_BEGIN + "function" + SEP + "get_time\n```json\n" + json.dumps(TIME_ARGS) + "\n```" + CALL_END
     + CALLS_END + EOS,
     ("I'll look both up.", "The user needs two lookups.\n", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])),
    ("deepseek", {},  # V3.1 form, no reasoning
     "Looking it up." + CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP + json.dumps(WEATHER_ARGS) + CALL_END
     + CALL_BEGIN + "get_time" + SEP + json.dumps(TIME_ARGS) + CALL_END + CALLS_END + EOS,
     ("Looking it up.", "", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])),
    ("deepseek", {},
     "<think>\nHmm.\n</think>\n\nUse `<｜` carefully: a <｜tool▁call x and ``` fences.",
     ("Use `<｜` carefully: a <｜tool▁call x and ``` fences.", "Hmm.\n", [])),
    ("mistral", {},
     "Let me check. [TOOL_CALLS] [" + json.dumps({"name": "get_weather", "arguments": WEATHER_ARGS}) + ", "
     + json.dumps({"arguments": TIME_ARGS, "name": "get_time", "id": "abc123XYZ"}) + "]</s>",
     ("Let me check. ", "", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])),
    ("mistral", {},
     "Lists look like [TOOLS] or [1, 2] and [TOOL_CALL] is not it.</s>",
     ("Lists look like [TOOLS] or [1, 2] and [TOOL_CALL] is not it.", "", [])),
    # Kimi-K2 / Kimi-Linear (Moonshot's tool-call guide): a section of calls named functions.NAME:INDEX
    ("kimi", {},
     "<think>Two lookups.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     "<|tool_call_argument_begin|>" + json.dumps(WEATHER_ARGS) + "<|tool_call_end|>\n<|tool_call_begin|>"
     "functions.get_time:1<|tool_call_argument_begin|>" + json.dumps(TIME_ARGS) + "<|tool_call_end|>"
     "<|tool_calls_section_end|><|im_end|>",
     ("Let me check.", "Two lookups.", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])),
    ("kimi", {},
     "A <|tool_call_begin|>functions.broken:0<|tool_call_argument_begin|>not json<|tool_call_end|> stays.<|im_end|>",
     ("A <|tool_call_begin|>functions.broken:0<|tool_call_argument_begin|>not json<|tool_call_end|> stays.", "",
      [])),
    # Llama-4's template asks for {"name": ..., "parameters": ...}; several calls are separated by ";"
    ("llama4", {},
     json.dumps({"name": "get_weather", "parameters": WEATHER_ARGS}) + "; "
     + json.dumps({"name": "get_time", "parameters": TIME_ARGS}) + "<|eot|>",
     ("", "", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])),
    ("llama4", {},
     "\n<|python_start|>" + json.dumps({"name": "get_weather", "parameters": WEATHER_ARGS})
     + "<|python_end|>\nI asked for the weather.<|eom|>",
     ("I asked for the weather.", "", [("get_weather", WEATHER_ARGS)])),
    ("llama4", {},
     "Text first, so {\"name\": \"x\", \"parameters\": {}} and [f(a=1)] are prose.<|eot|>",
     ("Text first, so {\"name\": \"x\", \"parameters\": {}} and [f(a=1)] are prose.", "", [])),
    ("plain", {},
     "<tool_call>{\"name\": \"x\", \"arguments\": {}}</tool_call> <think>plain</think>",
     ("<tool_call>{\"name\": \"x\", \"arguments\": {}}</tool_call> <think>plain</think>", "", [])),
]


def run(parser, chunks):
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return events


def summarize(events: list[OutputEvent], parser=None):
    """(text, reasoning, [(name, args)]), checking the event rules for tool calls on the way."""
    text = "".join(e.text for e in events if e.kind == "text")
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    calls: dict[int, dict] = {}
    for e in events:
        assert e.kind in ("text", "reasoning", "tool_call")
        if e.kind != "tool_call":
            assert e.text and not e.name and not e.arguments_delta
            continue
        if e.tool_index not in calls:
            assert e.name and not e.arguments_delta, "a call's first event carries its name and no arguments"
            assert e.tool_index == len(calls), "tool indices count up from 0"
            calls[e.tool_index] = {"id": e.tool_id, "name": e.name, "args": ""}
        else:
            assert not e.name and e.tool_id == calls[e.tool_index]["id"]
            calls[e.tool_index]["args"] += e.arguments_delta
    incomplete = set()
    if parser is not None:
        # every call that got events is either complete or incomplete, with exactly the pieces sent
        sent = {i: (i, c["id"], c["name"], c["args"]) for i, c in calls.items()}
        listed = parser.tool_calls + parser.incomplete_tool_calls
        assert sorted((c.index, c.id, c.name, c.arguments) for c in listed) == sorted(sent.values())
        assert parser.saw_tool_call == bool(calls)
        incomplete = {c.index for c in parser.incomplete_tool_calls}
    result = []
    for i, c in calls.items():
        if i not in incomplete:
            result.append((c["name"], json.loads(c["args"])))  # the pieces concatenate to valid JSON
    return text, reasoning, result


def random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("family, options, output, expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_same_result_in_any_split(family, options, output, expected):
    rng = random.Random(hash(output) % 1000)
    splits = [[output], list(output)] + [random_splits(output, rng) for _ in range(20)]
    splits += [[output[:i], output[i:]] for i in range(1, len(output))]  # every single boundary
    for chunks in splits:
        parser = output_parser_for(family, tools=True, **options)
        got = summarize(run(parser, chunks), parser)
        assert got == expected, f"split {chunks[:6]}..."
        for marker in MARKERS.get(family, []):
            assert marker not in got[0] and marker not in got[1] or marker in expected[0] + expected[1]


@pytest.mark.parametrize("family, options, output, expected", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_arguments_stream_before_the_call_closes(family, options, output, expected):
    """A call's name goes out before its arguments are complete, and arguments come in several pieces."""
    if not expected[2]:
        return
    parser = output_parser_for(family, tools=True, **options)
    first_name_at = None
    pieces = 0
    for i, ch in enumerate(output):
        for e in parser.feed(ch):
            if e.kind == "tool_call" and e.name and first_name_at is None:
                first_name_at = i
            pieces += bool(e.arguments_delta)
    parser.finish()
    first_args = parser.tool_calls[0].arguments
    assert first_name_at is not None and first_name_at < output.index(first_args) + len(first_args) - 1
    assert pieces > len(parser.tool_calls)


def test_text_streams_without_waiting_for_the_end():
    parser = output_parser_for("qwen3", tools=True)
    assert parser.feed("Hello") == [OutputEvent("text", "Hello")]
    assert parser.feed(" wor") == [OutputEvent("text", " wor")]
    assert parser.feed("ld <") == [OutputEvent("text", "ld ")]  # "<" could start <tool_call>
    assert parser.feed("too") == []
    assert parser.feed("th") == [OutputEvent("text", "<tooth")]
    assert parser.finish() == []


def test_non_stream_arguments_send_each_call_whole():
    output = CASES[0][2]
    parser = output_parser_for("qwen3", tools=True, stream_arguments=False)
    events = run(parser, list(output))
    calls = [e for e in events if e.kind == "tool_call"]
    assert [bool(e.name) for e in calls] == [True, False, True, False]
    assert summarize(events, parser) == CASES[0][3]


def test_tools_off_keeps_tool_markup_as_text():
    block = hermes_call("get_weather", WEATHER_ARGS)
    parser = output_parser_for("qwen3", tools=False)
    text, _, calls = summarize(run(parser, list("Hi " + block)), parser)
    assert (text, calls) == ("Hi " + block, [])


def test_reasoning_off_drops_reasoning_but_keeps_text():
    family, options, output, (text, _, calls) = CASES[0]
    parser = output_parser_for(family, tools=True, reasoning=False)
    events = run(parser, list(output))
    assert not [e for e in events if e.kind == "reasoning"]
    assert summarize(events, parser) == (text, "", calls)


def test_harmony_routes_builtin_tools_and_foreign_roles_away_from_text():
    output = ("<|channel|>analysis to=browser.search code<|message|>{\"query\": \"x\"}<|call|>"
              "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"t\": 1}<|end|>"
              "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    parser = output_parser_for("harmony", tools=True)
    assert summarize(run(parser, list(output)), parser) == ("Done.", "{\"query\": \"x\"}", [])


def test_harmony_function_call_from_the_analysis_channel():
    output = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>analysis "
              "to=functions.get_weather code<|message|>" + json.dumps(WEATHER_ARGS) + "<|call|>")
    parser = output_parser_for("harmony", tools=True)
    assert summarize(run(parser, list(output)), parser) == ("", "Need weather.", [("get_weather", WEATHER_ARGS)])


def test_harmony_output_without_structure_is_text():
    text = "plain words " * 40
    parser = output_parser_for("harmony", tools=True)
    assert summarize(run(parser, list(text)), parser)[0] == text
    parser = output_parser_for("harmony", tools=True)
    assert summarize(run(parser, ["short"]), parser)[0] == "short"


def test_harmony_tools_off_shows_call_content_as_text():
    output = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>"
    parser = output_parser_for("harmony", tools=False)
    assert summarize(run(parser, [output]), parser) == ("{\"city\": \"Paris\"}", "", [])


# -- failed calls -------------------------------------------------------------------------------
MALFORMED = [
    ("qwen3", "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Paris'}}\n</tool_call>"),
    ("qwen3", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {'city': 'Paris'}}\n</tool_call>"),
    ("qwen3", "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    ("qwen3", "<tool_call>\n{\"arguments\": {}}\n</tool_call>"),
    ("qwen3", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": [1, 2]}\n</tool_call>"),
    ("deepseek", CALL_BEGIN + "get_weather" + SEP + "{city: Paris}" + CALL_END),
    ("deepseek", CALL_BEGIN + "function" + SEP + "get_weather\n```python\nprint(1)\n```" + CALL_END),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>city=Paris<|call|>"),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {city: 1}}]"),
    ("mistral", "[TOOL_CALLS] get_weather(city=1)"),
]


@pytest.mark.parametrize("family, block", MALFORMED)
def test_malformed_call_comes_out_as_text(family, block):
    for chunks in ([block], list(block)):
        before = "<|channel|>final<|message|>Before. <|end|><|start|>assistant" if family == "harmony" else "Before. "
        parser = output_parser_for(family, tools=True)
        text, reasoning, calls = summarize(run(parser, [before, *chunks]), parser)
        assert calls == [] and parser.tool_calls == [] and not parser.saw_tool_call
        shown = block if family != "harmony" else "city=Paris"  # harmony: the content, not the header
        assert text == "Before. " + shown


def test_malformed_after_streaming_started_is_an_incomplete_call():
    block = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": 'Paris'}}\n</tool_call>"
    parser = output_parser_for("qwen3", tools=True)
    events = run(parser, list(block + "After."))
    assert [e.name for e in events if e.kind == "tool_call" and e.name] == ["get_weather"]
    assert parser.tool_calls == [] and parser.saw_tool_call
    assert [(c.name, c.arguments) for c in parser.incomplete_tool_calls] == [("get_weather", "{\"city\": ")]
    assert summarize(events, parser) == ("After.", "", [])
    # without streaming the same block is text: nothing of it went out before the JSON broke
    parser = output_parser_for("qwen3", tools=True, stream_arguments=False)
    assert summarize(run(parser, list(block)), parser) == (block, "", [])


@pytest.mark.parametrize("family, output", [
    ("qwen3", "Hi <tool_call>\n{\"na"),
    ("qwen3", "Hi <tool_call>\n{\"name\": \"get_weather\", \"argu"),
    ("deepseek", "Hi " + CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_wea"),
    ("mistral", "Hi [TOOL_CALLS] [{\"name\": \"get_weather\""),
    ("harmony", "<|channel|>final<|message|>Hi <|end|><|start|>assistant<|channel|>commentary to=functions.get"),
])
def test_unfinished_call_before_any_event_is_text_or_dropped(family, output):
    for chunks in ([output], list(output)):
        parser = output_parser_for(family, tools=True)
        text, _, calls = summarize(run(parser, chunks), parser)
        assert calls == [] and parser.incomplete_tool_calls == [] and text.startswith("Hi ")
        if family != "harmony":  # harmony headers are structure, never text
            assert text == output.replace(CALLS_BEGIN, "")


@pytest.mark.parametrize("family, output", [
    ("qwen3", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par"),
    ("deepseek", CALL_BEGIN + "get_weather" + SEP + "{\"city\": \"Par"),
    ("harmony", "<|channel|>commentary to=functions.get_weather json<|message|>{\"city\": \"Par"),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par"),
])
def test_unfinished_call_after_streaming_started_is_incomplete(family, output):
    parser = output_parser_for(family, tools=True)
    events = run(parser, list(output))
    assert parser.tool_calls == [] and parser.saw_tool_call
    (call,) = parser.incomplete_tool_calls
    sent = "".join(e.arguments_delta for e in events if e.kind == "tool_call")
    assert call.name == "get_weather" and call.arguments == sent and sent.startswith("{\"city\": \"P")
    assert summarize(events, parser) == ("", "", [])


@pytest.mark.parametrize("family, output", [
    ("qwen3", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"),
    ("qwen3", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}"),
    ("deepseek", CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "get_weather\n```json\n{\"city\": \"Paris\"}\n```"),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"),
])
def test_complete_arguments_without_closing_marker_make_a_call(family, output):
    parser = output_parser_for(family, tools=True)
    assert summarize(run(parser, list(output)), parser) == ("", "", [("get_weather", {"city": "Paris"})])


def test_unknown_tool_name_is_text():
    block = hermes_call("rm_rf", {"path": "/"})
    parser = output_parser_for("qwen3", tools=True, tool_names={"get_weather"})
    assert summarize(run(parser, list(block)), parser) == (block, "", [])
    parser = output_parser_for("qwen3", tools=True, tool_names={"get_weather"})
    ok = hermes_call("get_weather", WEATHER_ARGS)
    assert summarize(run(parser, [ok]), parser)[2] == [("get_weather", WEATHER_ARGS)]


def test_hermes_variants_parameters_key_and_string_arguments():
    output = ("<tool_call>\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}\n</tool_call>"
              "<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"UTC\\\"}\"}\n</tool_call>")
    parser = output_parser_for("hermes", tools=True)
    assert summarize(run(parser, list(output)), parser)[2] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_time", {"tz": "UTC"})]


def test_tool_ids():
    parser = output_parser_for("qwen3", tools=True)
    run(parser, [CASES[0][2]])
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in parser.tool_calls)
    assert len({c.id for c in parser.tool_calls}) == 2
    parser = output_parser_for("mistral", tools=True)
    run(parser, [CASES[10][2]])
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in parser.tool_calls)  # Mistral's templates insist


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt_opens_reasoning("deepseek", "<｜Assistant｜><think>\n")
    assert not prompt_opens_reasoning("hermes", "<think>\n")
    assert not prompt_opens_reasoning("plain", "<think>\n")


def test_every_tool_format_has_a_case():
    assert TOOL_FORMATS == {c[0] for c in CASES if c[3][2]} | {"hermes"} | {c[0] for c in XML_CASES} | {"gemma4"}


def test_finish_is_final():
    parser = output_parser_for("qwen3", tools=True)
    parser.feed("hi")
    parser.finish()
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("more")


# -- Qwen3-Coder's XML calls ----------------------------------------------------------------------
CODER_OUTPUT = (
    "I'll write the file.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
    "<parameter=content>\ndef f(x):\n    return x < 3 and \"</param\" != x\n\n</parameter>\n"
    "<parameter=mode>\n420\n</parameter>\n<parameter=opts>\n{\"force\": true}\n</parameter>\n"
    "<parameter=dry>\nfalse\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=list_files>\n</function>\n</tool_call><|im_end|>")
CODER_SCHEMAS = {"write_file": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "opts": {"type": "object"}, "dry": {"type": ["boolean", "null"]}}}}


def test_qwen3_coder_xml_calls_in_any_split():
    expected_args = {"path": "src/a.py", "content": "def f(x):\n    return x < 3 and \"</param\" != x\n",
                     "mode": 420, "opts": {"force": True}, "dry": False}
    rng = random.Random(3)
    for chunks in [[CODER_OUTPUT], list(CODER_OUTPUT)] + [random_splits(CODER_OUTPUT, rng) for _ in range(20)]:
        parser = output_parser_for("qwen3", tools=True, tool_parameters=CODER_SCHEMAS)
        assert summarize(run(parser, chunks), parser) == (
            "I'll write the file.\n", "", [("write_file", expected_args), ("list_files", {})])
    # without schemas every value is a string
    parser = output_parser_for("qwen3", tools=True)
    args = summarize(run(parser, [CODER_OUTPUT]), parser)[2][0][1]
    assert args["mode"] == "420" and args["opts"] == "{\"force\": true}"


def test_qwen3_coder_malformed_and_unfinished():
    bad = "<tool_call>\n<function=write_file>\nstray text\n</function>\n</tool_call>"
    parser = output_parser_for("qwen3", tools=True)
    assert summarize(run(parser, list(bad)), parser) == (bad, "", [])
    cut = "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=content>\nabc"
    parser = output_parser_for("qwen3", tools=True)
    events = run(parser, list(cut))
    assert parser.tool_calls == [] and [c.arguments for c in parser.incomplete_tool_calls] == ['{"path": "src/a.py"']
    assert summarize(events, parser) == ("", "", [])


# -- GLM-4.5 .. GLM-5 (<arg_key>/<arg_value>) and DeepSeek-V3.2 / V4 (DSML) calls --------------------------------
# Raw values: a string as written, everything else as JSON (GLM's templates use tojson; DSML marks string="false").
# Written as the families' own chat templates / encoding scripts render an assistant turn with these calls.
GLM_SCHEMAS = {"write_file": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "opts": {"type": "object"}}}}
WRITE_ARGS = {"path": "src/a.py", "content": "if x < 3 and \"</arg\" != x:\n    pass\n", "mode": 420,
              "opts": {"force": True, "tags": ["a", "b"]}}


def glm_call(name: str, args: dict, sep: str = "\n") -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>{sep}"
                    for k, v in args.items())
    return f"<tool_call>{name}{sep}{pairs}</tool_call>"


DSML = "｜DSML｜"


def dsml_calls(calls: list[tuple[str, dict]], section: str = "function_calls") -> str:
    invokes = []
    for name, args in calls:
        params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else json.dumps(v)}</{DSML}parameter>' for k, v in args.items()]
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}{section}>\n" + "\n".join(invokes) + f"\n</{DSML}{section}>"


def minimax_calls(calls: list[tuple[str, dict]]) -> str:
    """As MiniMax-M2's tool-calling guide shows its output: raw values, JSON for everything but strings."""
    invokes = []
    for name, args in calls:
        params = [f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>'
                  for k, v in args.items()]
        invokes.append(f'<invoke name="{name}">\n' + "\n".join(params) + "\n</invoke>")
    return "<minimax:tool_call>\n" + "\n".join(invokes) + "\n</minimax:tool_call>"


# MiniMax-M2.5's guide, "Model Output Format": two parallel invokes with JSON-array values
MINIMAX_GUIDE = ('<minimax:tool_call>\n<invoke name="search_web">\n<parameter name="query_tag">["technology", '
                 '"events"]</parameter>\n<parameter name="query_list">["\\"OpenAI\\" \\"latest\\" \\"release\\""]'
                 '</parameter>\n</invoke>\n<invoke name="search_web">\n<parameter name="query_tag">["technology", '
                 '"events"]</parameter>\n<parameter name="query_list">["\\"Gemini\\" \\"latest\\" \\"release\\""]'
                 '</parameter>\n</invoke>\n</minimax:tool_call>')
# MiniMax's reference parser drops a newline at each end of a value: a value written here has none
MINIMAX_WRITE = dict(WRITE_ARGS, content=WRITE_ARGS["content"].rstrip("\n"))
SEARCH = {"search_web": {"type": "object", "properties": {"query_list": {"type": "array", "items": {"type": "string"}},
                                                          "query_tag": {"type": "array", "items": {"type": "string"}}}}}

XML_CASES = [
    ("glm", {},  # GLM-4.5: newlines after the name and between the pairs
     "<think>The user wants the weather, then a file.</think>\nChecking.\n" + glm_call("get_weather", WEATHER_ARGS)
     + "\n" + glm_call("write_file", WRITE_ARGS) + "<|observation|>",
     ("Checking.\n", "The user wants the weather, then a file.", [("get_weather", WEATHER_ARGS),
                                                                  ("write_file", WRITE_ARGS)])),
    ("glm", {"starts_in_reasoning": True},  # GLM-4.7 / GLM-5: back to back, <think> opened by the prompt
     "Weather first.</think>" + glm_call("get_weather", WEATHER_ARGS, sep="") + glm_call("get_time", {}, sep=""),
     ("", "Weather first.", [("get_weather", WEATHER_ARGS), ("get_time", {})])),
    ("glm", {},
     "<think></think>Tags like <tool and <arg_key> in prose stay text: a < b.<|user|>",
     ("Tags like <tool and <arg_key> in prose stay text: a < b.", "", [])),
    ("dsml", {"starts_in_reasoning": True},
     "Two lookups are needed.</think>I'll look both up." + dsml_calls([("get_weather", WEATHER_ARGS),
                                                                        ("write_file", WRITE_ARGS)])
     + "<｜end▁of▁sentence｜>",
     ("I'll look both up.\n\n", "Two lookups are needed.", [("get_weather", WEATHER_ARGS),
                                                             ("write_file", WRITE_ARGS)])),
    ("dsml", {},  # chat mode (the prompt closed </think>), DeepSeek-V4's section name
     "Done." + dsml_calls([("get_time", TIME_ARGS)], section="tool_calls") + "\nAfter.",
     ("Done.\n\nAfter.", "", [("get_time", TIME_ARGS)])),
    ("minimax", {"starts_in_reasoning": True},  # the prompt ends "]~b]ai\n<think>\n"; interleaved thinking
     "The user wants the weather, then a file.\n</think>\n\nLet me help you query the weather.\n"
     + minimax_calls([("get_weather", WEATHER_ARGS), ("write_file", MINIMAX_WRITE)]) + "[e~[",
     ("Let me help you query the weather.\n", "The user wants the weather, then a file.\n",
      [("get_weather", WEATHER_ARGS), ("write_file", MINIMAX_WRITE)])),
    ("minimax", {}, MINIMAX_GUIDE,
     ("", "", [("search_web", {"query_tag": ["technology", "events"], "query_list": ['"OpenAI" "latest" "release"']}),
               ("search_web", {"query_tag": ["technology", "events"], "query_list": ['"Gemini" "latest" "release"']})])),
    ("minimax", {},
     "<think></think>XML in prose stays text: <invoke name=\"x\"> and <minimax:tool a < b.[e~[",
     ("XML in prose stays text: <invoke name=\"x\"> and <minimax:tool a < b.", "", [])),
]
XML_MARKERS = {
    "glm": ["<tool_call>", "</tool_call>", "<arg_value>", "</arg_value>", "<think>", "</think>", "<|user|>",
                 "<|observation|>"],
    "dsml": [f"<{DSML}", f"</{DSML}", "<think>", "<｜end▁of▁sentence｜>"],
    "minimax": ["<minimax:tool_call>", "</minimax:tool_call>", "</invoke>", "</parameter>", "<think>", "[e~["],
}


@pytest.mark.parametrize("family, options, output, expected", XML_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(XML_CASES)])
def test_glm_and_dsml_calls_in_any_split(family, options, output, expected):
    rng = random.Random(len(output))
    splits = [[output], list(output)] + [random_splits(output, rng) for _ in range(20)]
    splits += [[output[:i], output[i:]] for i in range(1, len(output))]
    for chunks in splits:
        parser = output_parser_for(family, tools=True, tool_parameters={**GLM_SCHEMAS, **SEARCH}, **options)
        got = summarize(run(parser, chunks), parser)
        assert got == expected, f"split {chunks[:6]}..."
        for marker in XML_MARKERS[family]:
            assert marker not in got[0] and marker not in got[1] or marker in expected[0] + expected[1]


@pytest.mark.parametrize("family, output", [(c[0], c[2]) for c in XML_CASES if c[3][2]])
def test_glm_and_dsml_arguments_stream_pair_by_pair(family, output):
    """The name goes out with the first pair, and each later pair is its own piece, before the call closes."""
    parser = output_parser_for(family, tools=True, tool_parameters={**GLM_SCHEMAS, **SEARCH},
                               starts_in_reasoning="<think>" not in output and "</think>" in output)
    named_at, pieces = None, 0
    close = {"dsml": f"</{DSML}invoke>", "minimax": "</invoke>"}.get(family, "</tool_call>")
    for i, ch in enumerate(output):
        for e in parser.feed(ch):
            if e.kind == "tool_call" and e.name and named_at is None:
                named_at = i
            pieces += bool(e.arguments_delta)
    parser.finish()
    assert named_at is not None and named_at < output.index(close)
    assert pieces > len(parser.tool_calls)


def test_values_without_a_schema_are_json_when_they_parse():
    output = glm_call("f", {"n": 7, "s": "plain", "o": {"a": 1}})
    parser = output_parser_for("glm", tools=True)
    assert summarize(run(parser, [output]), parser)[2] == [("f", {"n": 7, "s": "plain", "o": {"a": 1}})]
    # the schema wins: a string parameter keeps "7" a string
    parser = output_parser_for("glm", tools=True, tool_parameters={"f": {"properties": {"n": {"type": "string"}}}})
    assert summarize(run(parser, [output]), parser)[2][0][1]["n"] == "7"
    # DSML: string="true" is a string whatever it looks like; string="false" is JSON
    dsml = dsml_calls([("f", {"n": "7", "m": 7})])
    parser = output_parser_for("dsml", tools=True)
    assert summarize(run(parser, [dsml]), parser)[2] == [("f", {"n": "7", "m": 7})]


@pytest.mark.parametrize("family, block", [
    ("glm", "<tool_call>get_weather\n<arg_value>Paris</arg_value>\n</tool_call>"),
    ("glm", "<tool_call>\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
    ("glm", "<tool_call>get_weather\n{\"city\": \"Paris\"}\n</tool_call>"),
    ("dsml", f'<{DSML}function_calls>\n<{DSML}invoke name="get_weather">\n<{DSML}arg>Paris</{DSML}arg>\n'
                     f"</{DSML}invoke>\n</{DSML}function_calls>"),
])
def test_glm_and_dsml_malformed_calls_come_out_as_text(family, block):
    for chunks in ([block], list(block)):
        parser = output_parser_for(family, tools=True)
        text, _, calls = summarize(run(parser, ["Before. ", *chunks]), parser)
        assert calls == [] and parser.tool_calls == [] and not parser.saw_tool_call
        shown = block if family != "dsml" else block[block.index(f'<{DSML}invoke'):block.index(f"\n</{DSML}f")]
        assert text == "Before. " + shown


@pytest.mark.parametrize("family, output, sent", [
    ("glm", "<tool_call>write_file\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n<arg_key>content"
                 "</arg_key>\n<arg_value>abc", '{"path": "a.py"'),
    ("dsml", f'<{DSML}function_calls>\n<{DSML}invoke name="write_file">\n<{DSML}parameter name="path" '
                     f'string="true">a.py</{DSML}parameter>\n<{DSML}parameter name="content" string="true">ab',
     '{"path": "a.py"'),
])
def test_glm_and_dsml_unfinished_calls_are_incomplete(family, output, sent):
    parser = output_parser_for(family, tools=True)
    events = run(parser, list(output))
    assert parser.tool_calls == [] and [c.arguments for c in parser.incomplete_tool_calls] == [sent]
    assert summarize(events, parser) == ("", "", [])


def test_minimax_values_on_lines_of_their_own():
    """MiniMax-M2 may write a value on its own lines; one newline at each end is not part of it (as MiniMax's
    reference parser reads it)."""
    output = ('<minimax:tool_call>\n<invoke name="f">\n<parameter name="city">\nParis\n</parameter>\n'
              '<parameter name="n">\n7\n</parameter>\n</invoke>\n</minimax:tool_call>')
    parser = output_parser_for("minimax", tools=True, tool_parameters={"f": {"properties": {
        "city": {"type": "string"}, "n": {"type": "integer"}}}})
    assert summarize(run(parser, list(output)), parser)[2] == [("f", {"city": "Paris", "n": 7})]


def test_glm_and_dsml_prompts_open_reasoning():
    assert prompt_opens_reasoning("glm", "<|user|>hi<|assistant|><think>")
    assert prompt_opens_reasoning("dsml", "<｜User｜>hi<｜Assistant｜><think>")
    assert prompt_opens_reasoning("minimax", "]~b]user\nhi[e~[\n]~b]ai\n<think>\n")
    assert not prompt_opens_reasoning("dsml", "<｜User｜>hi<｜Assistant｜></think>")


# Llama-4's pythonic calls (Meta's Llama-4 prompt guide, vLLM's llama4_pythonic template): output, (text, calls)
PYTHONIC_CASES = [
    ('[get_weather(city="San Francisco", metric="celsius")]<|eot|>',
     ("", [("get_weather", {"city": "San Francisco", "metric": "celsius"})])),
    ("[get_weather(city='Paris', unit=\"celsius\"), get_time(tz='Europe/Paris', nested={'list': [1, 2.5, -300.0, True, "
     "None], 's': 'a \"quoted\" } ] <tag>'})]\nBoth asked.<|eot|>",
     ("Both asked.", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])),
    ("[1, 2, 3] is a list, not a call.<|eot|>", ("[1, 2, 3] is a list, not a call.", [])),
    ("[see the docs](https://example.com)<|eot|>", ("[see the docs](https://example.com)", [])),
    ("[broken(a=1, b=)]<|eot|>", ("[broken(a=1, b=)]", [])),
    ("[f(x=open('/etc/passwd'))]<|eot|>", ("[f(x=open('/etc/passwd'))]", [])),  # literals only: never evaluated
]


@pytest.mark.parametrize("output, expected", PYTHONIC_CASES)
def test_llama4_pythonic_calls_in_any_split(output, expected):
    rng = random.Random(len(output))
    splits = [[output], list(output)] + [random_splits(output, rng) for _ in range(10)]
    splits += [[output[:i], output[i:]] for i in range(1, len(output))]
    for chunks in splits:
        parser = output_parser_for("llama4", tools=True)
        text, _, calls = summarize(run(parser, chunks), parser)
        assert (text, calls) == expected, f"split {chunks[:6]}..."


def test_llama4_text_that_cannot_be_a_call_streams_at_once():
    parser = output_parser_for("llama4", tools=True)
    assert [e.text for e in parser.feed("[see")] == [] and parser.feed(" the docs") != []
    parser = output_parser_for("llama4", tools=True)
    assert parser.feed("Hello") == [OutputEvent(kind="text", text="Hello")]


def test_llama4_calls_to_tools_not_offered_are_text():
    output = '[rm(path="/")]<|eot|>'
    parser = output_parser_for("llama4", tools=True, tool_names=["get_weather"])
    assert summarize(run(parser, [output]), parser) == ('[rm(path="/")]', "", [])


# Gemma-4 (Google's prompt-formatting guide; transformers' Gemma-4 response parser): output, options, (text, reasoning,
# calls). Its calls go out whole when they close.
GEMMA4_CASES = [
    ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}<tool_call|><|tool_response>', {},
     ("", "", [("get_weather", WEATHER_ARGS)])),
    ('<|channel>thought\nThe user wants two things.<channel|>Checking both.<|tool_call>call:get_weather{city:<|"|>Paris'
     '<|"|>,unit:<|"|>celsius<|"|>}<tool_call|><|tool_call>call:get_time{tz:<|"|>Europe/Paris<|"|>,nested:{list:[1,2.5,'
     '-3e2,true,null],s:<|"|>a "quoted" } ] <tag><|"|>}}<tool_call|><|tool_response>', {},
     ("Checking both.", "The user wants two things.", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])),
    ('<|channel>thought\n<channel|>The answer is 4; a <|tool_call> needs call:NAME{..} to be a call.<turn|>', {},
     ('The answer is 4; a <|tool_call> needs call:NAME{..} to be a call.', "", [])),
    ('<|tool_call>call:get_weather{city:Paris}<tool_call|><turn|>', {},  # a bare string value: not Gemma's syntax
     ('<|tool_call>call:get_weather{city:Paris}<tool_call|>', "", [])),
    ('<|tool_call>call:get_weather{"city": "Paris", "unit": "celsius"}<tool_call|>', {},  # quoted JSON is read too
     ("", "", [("get_weather", WEATHER_ARGS)])),
]


@pytest.mark.parametrize("output, options, expected", GEMMA4_CASES)
def test_gemma4_calls_and_reasoning_in_any_split(output, options, expected):
    rng = random.Random(len(output))
    splits = [[output], list(output)] + [random_splits(output, rng) for _ in range(10)]
    splits += [[output[:i], output[i:]] for i in range(1, len(output))]
    for chunks in splits:
        parser = output_parser_for("gemma4", tools=True, **options)
        assert summarize(run(parser, chunks), parser) == expected, f"split {chunks[:6]}..."


def test_gemma4_calls_to_tools_not_offered_and_unfinished_calls_are_text():
    output = '<|tool_call>call:rm{path:<|"|>/<|"|>}<tool_call|>'
    parser = output_parser_for("gemma4", tools=True, tool_names=["get_weather"])
    assert summarize(run(parser, [output]), parser) == (output, "", [])
    cut = '<|tool_call>call:get_weather{city:<|"|>Par'
    parser = output_parser_for("gemma4", tools=True)
    assert summarize(run(parser, [cut]), parser) == (cut, "", []) and parser.tool_calls == []


def test_kimi_call_ids_are_the_models_own():
    output = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>"
              + json.dumps(WEATHER_ARGS) + "<|tool_call_end|><|tool_calls_section_end|>")
    parser = output_parser_for("kimi", tools=True)
    run(parser, list(output))
    assert [(c.id, c.name) for c in parser.tool_calls] == [("functions.get_weather:3", "get_weather")]
