"""Ollama's API (issue #35) with the official ``ollama`` Python client as the test client: chat, generate, their
streams, list, show, ps, delete, version; models named as Ollama names them, loaded on demand from a fake Ollama
store laid out as Ollama writes it (the GGUF blob read in place), options / format / think / tools / keep_alive
as Ollama's clients send them, and Ollama's error shape."""

from __future__ import annotations

import json
import time

import httpx
import ollama
import pytest
from gguf import GGMLQuantizationType as T

from helpers.gguf_writer import write_tiny_gguf
from helpers.http_daemon import ChatScriptedModel, add_scripted_model, start_http_daemon, tools_tokenizer
from helpers.model_stores import add_ollama_model
from helpers.tiny_models import build_tiny_model, tiny_config
from helpers.tiny_tokenizer import write_tiny_tokenizer
from helpers.tool_templates import install_tool_template
from moed.catalog.catalog import Catalog, CatalogRoots
from moed.engine.model_manager import LoadOptions
from moed.engine.model_pool import PoolConfig

ASK = [{"role": "user", "content": "The router reads"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("ollama-api")
    gguf, _, _ = write_tiny_gguf("qwen3_moe", root / "build", expert_type=T.Q8_0, weight_type=T.Q8_0,
                                 max_position_embeddings=2048)
    store = root / "ollama"
    add_ollama_model(store, gguf, "tiny-qwen:latest", params={"stop": ["<|im_end|>"], "temperature": 0.0},
                     system="You are terse.")
    own = root / "moed"
    config = tiny_config("qwen3_moe")
    config.max_position_embeddings = 2048
    build_tiny_model("qwen3_moe", own / "toolish", config=config)
    write_tiny_tokenizer(own / "toolish")
    install_tool_template(own / "toolish")
    catalog = Catalog(CatalogRoots(moed=(own,), ollama=(store,)))
    d = start_http_daemon(own, catalog=catalog, pool=PoolConfig(keep_alive_s=300),
                          options=LoadOptions(device="cpu", max_batch=4, context_length=1024))
    # a model whose answers the test writes: it thinks, then calls get_weather (Qwen3's syntax)
    scripted = ChatScriptedModel(tools_tokenizer(root / "scripted"), lambda prompt: (
        "<think>\nNeed the weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        if "tool_response" not in prompt else "It is sunny in Paris."))
    add_scripted_model(d, "scripted", scripted)
    yield d
    d.close()


@pytest.fixture(scope="module")
def client(daemon):
    return daemon.ollama()


def test_chat_loads_the_ollama_model_on_demand_and_answers(client, daemon):
    done = client.chat(model="tiny-qwen", messages=ASK, options={"num_predict": 6, "temperature": 0})
    assert done.done and done.done_reason in ("stop", "length") and done.message.role == "assistant"
    assert done.eval_count == 6 or done.done_reason == "stop"
    assert done.prompt_eval_count > 0 and done.total_duration > 0
    assert "tiny-qwen:latest" in {e.name for e in daemon.manager.loaded()}
    again = client.chat(model="tiny-qwen:latest", messages=ASK, options={"num_predict": 6, "temperature": 0})
    assert again.message.content == done.message.content  # greedy: the same answer


def test_streamed_chat_is_ndjson_deltas_then_a_final_object(client):
    parts = list(client.chat(model="tiny-qwen", messages=ASK, stream=True, options={"num_predict": 8,
                                                                                    "temperature": 0}))
    assert parts[-1].done and all(not p.done for p in parts[:-1]) and len(parts) >= 2
    whole = client.chat(model="tiny-qwen", messages=ASK, options={"num_predict": 8, "temperature": 0})
    assert "".join(p.message.content for p in parts) == whole.message.content


def test_generate_and_its_stream(client):
    done = client.generate(model="tiny-qwen", prompt="The router reads", options={"num_predict": 5, "seed": 3})
    assert done.done and isinstance(done.response, str) and done.eval_count <= 5
    parts = list(client.generate(model="tiny-qwen", prompt="The router reads", stream=True, raw=True,
                                 options={"num_predict": 5, "temperature": 0}))
    assert parts[-1].done and parts[-1].eval_count == 5 or parts[-1].done_reason == "stop"


def test_list_show_ps_and_version(client, daemon):
    client.chat(model="tiny-qwen", messages=ASK, options={"num_predict": 1})
    names = {m.model for m in client.list().models}
    assert {"tiny-qwen:latest", "toolish"} <= names
    shown = client.show("tiny-qwen")
    assert "stop" in shown.parameters and shown.details.format == "gguf" and "completion" in shown.capabilities
    running = client.ps().models
    tiny = next(m for m in running if m.model == "tiny-qwen:latest")
    assert tiny.context_length == 1024 and tiny.expires_at is not None and tiny.size > 0
    openai_ids = {m.id: m for m in daemon.openai().models.list().data}  # OpenAI clients see the same models
    assert {"tiny-qwen:latest", "toolish"} <= set(openai_ids)
    assert openai_ids["toolish"].model_extra.get("loaded") in (True, False)
    version = httpx.get(f"{daemon.url}/api/version").json()
    assert version["version"] and version["moed"]


def test_format_schema_think_false_and_keep_alive(client, daemon):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
    for seed in range(3):
        # Qwen3's template closes the reasoning block when think is false: the schema holds from the first token
        done = client.chat(model="toolish", messages=ASK, format=schema, think=False,
                           options={"num_predict": 60, "temperature": 1.0, "seed": seed})
        assert isinstance(json.loads(done.message.content)["n"], int), done.message.content
    client.generate(model="tiny-qwen", prompt="", keep_alive=0)  # Ollama's "unload now"
    deadline = time.monotonic() + 10
    while "tiny-qwen:latest" in {e.name for e in daemon.manager.loaded()}:
        assert time.monotonic() < deadline, "keep_alive 0 did not unload the model"
        time.sleep(0.05)
    loaded = client.generate(model="tiny-qwen", prompt="")  # an empty prompt loads
    assert loaded.done_reason == "load" and "tiny-qwen:latest" in {e.name for e in daemon.manager.loaded()}


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_and_tool_calls_come_back_as_ollamas_fields(client, stream):
    out = client.chat(model="scripted", messages=ASK, tools=[WEATHER], think=True, stream=stream)
    parts = list(out) if stream else [out]
    thinking = "".join(p.message.thinking or "" for p in parts)
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert thinking.strip() == "Need the weather."
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "".join(p.message.content for p in parts).strip() == ""
    follow = [*ASK, {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
              {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    answer = client.chat(model="scripted", messages=follow, tools=[WEATHER])
    assert answer.message.content == "It is sunny in Paris." and not answer.message.tool_calls


def test_a_tool_call_turn_from_an_ollama_client_renders(client):
    """A tool-calling turn as Ollama's clients send it back: tool_calls with object arguments, then the tool's
    answer by tool_name; the model (a random tiny one) answers after it."""
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    done = client.chat(model="toolish", messages=messages, tools=[WEATHER], think=False,
                       options={"num_predict": 5})
    assert done.done


def test_errors_in_ollamas_shape(client, daemon):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such:model", messages=ASK)
    assert info.value.status_code == 404 and "not found" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="tiny-qwen", messages=ASK, options={"mirostat": 2})
    assert info.value.status_code == 400 and "mirostat" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="tiny-qwen", messages=ASK, keep_alive="soon")
    assert info.value.status_code == 400 and "keep_alive" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("tiny-qwen")  # Ollama's files are Ollama's
    assert info.value.status_code == 400 and "ollama rm" in info.value.error
    bad = httpx.post(f"{daemon.url}/api/chat", content=b"{nope")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]
    embed = httpx.post(f"{daemon.url}/api/embed", json={"model": "tiny-qwen", "input": "x"})
    assert embed.status_code == 501 and "embeddings" in embed.json()["error"]


def test_delete_removes_a_model_from_moeds_folder(client, daemon, tmp_path):
    own = daemon.manager.search_dirs[0]
    build_tiny_model("qwen3_moe", own / "scratch")
    write_tiny_tokenizer(own / "scratch")
    client.delete("scratch")
    assert not (own / "scratch").exists()
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("scratch")
    assert info.value.status_code == 404
