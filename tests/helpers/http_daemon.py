"""An in-process daemon with the HTTP gateway on a free loopback port, for the HTTP API tests.

``start_http_daemon(models_dir, ...)`` builds a DaemonContext + ModelManager, loads the named
models (e.g. the tiny model of ``helpers.tiny_models.build_tiny_model_dir``) and starts an
``HttpServer`` on 127.0.0.1:0: the same pieces ``moed serve --http`` runs, without a process.
``add_scripted_model`` puts a ``ChatScriptedModel`` (outputs written in the test) next to them, with
a tokenizer whose chat template renders tools the way Qwen3's does (``helpers.tool_templates``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from helpers.scripted_model import ScriptedConfig, ScriptedModel
from helpers.tiny_tokenizer import write_tiny_tokenizer
from helpers.tool_templates import QWEN3_TOOL_TEMPLATE
from moed.api.daemon_context import DaemonContext
from moed.api.http.server import HttpServer
from moed.engine.engine_loop import EngineLoop
from moed.engine.model_manager import LoadedEntry, LoadOptions, ModelManager
from moed.engine.runtime import ModelRuntime
from moed.text.tokenizer import Tokenizer

EOS = 3  # "<|im_end|>" in the tiny tokenizer
GENERATION_PROMPT = "<|im_start|>assistant\n"

@dataclass
class HttpDaemon:
    ctx: DaemonContext
    manager: ModelManager
    server: HttpServer
    token: str | None

    @property
    def url(self) -> str:
        return self.server.url

    def openai(self, **kw):
        import openai

        kw.setdefault("api_key", self.token or "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kw)

    def anthropic(self, **kw):
        import anthropic

        kw.setdefault("api_key", self.token or "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60)
        return anthropic.Anthropic(base_url=self.url, **kw)

    def ollama(self, **kw):
        import ollama

        if self.token:
            kw.setdefault("headers", {"Authorization": f"Bearer {self.token}"})
        kw.setdefault("timeout", 60)
        return ollama.Client(host=self.url, **kw)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no loop has a running or queued request (cancellations land at a step boundary)."""
        deadline = time.monotonic() + timeout
        while any(e.loop.num_active or e.loop.num_queued for e in self.manager.loaded()):
            assert time.monotonic() < deadline, "requests are still running"
            time.sleep(0.01)

    def close(self) -> None:
        """In `moed serve`'s order: refuse new requests, close the models (cancels running ones), stop."""
        self.ctx.stopping = True
        if self.ctx.pool is not None:
            self.ctx.pool.stop()
        self.manager.close()
        self.server.stop()


def start_http_daemon(models_dir: Path | None = None, *, models: tuple[str, ...] = (), token: str | None = None,
                      options: LoadOptions | None = None, catalog=None, pool=None) -> HttpDaemon:
    """A context + manager over ``models_dir`` with ``models`` loaded, and an HttpServer on 127.0.0.1:0;
    ``catalog``: where else models are found by name; ``pool``: a PoolConfig to load models on demand (its
    options default to ``options``)."""
    import dataclasses

    from moed.engine.model_pool import ModelPool, PoolConfig

    manager = ModelManager([models_dir] if models_dir else [], catalog=catalog)
    options = options or LoadOptions(device="cpu", max_batch=4, context_length=256)
    if pool is True:
        pool = PoolConfig()
    model_pool = None if pool is None else ModelPool(manager, dataclasses.replace(pool, options=options))
    ctx = DaemonContext(manager=manager, pool=model_pool)
    if model_pool is not None:
        model_pool.start()
    server = None
    try:
        for name in models:
            manager.load(name, options)
        server = HttpServer(ctx, "127.0.0.1:0", token)
        server.start()
    except BaseException:
        if server is not None:
            server.stop()
        manager.close()
        raise
    return HttpDaemon(ctx, manager, server, token)


# ---- a scripted model behind a chat template ----

@dataclass(frozen=True)
class ChatScriptedConfig(ScriptedConfig):
    family: str = "qwen3_moe"


class _NoExecutor:
    stats = type("Stats", (), {"device": "cpu", "cache_bytes": 0, "model_device_bytes": 0, "policy": "-"})()

    def close(self) -> None:
        pass


class ChatScriptedModel(ScriptedModel):
    """Answers chat prompts with text chosen by the test: ``answer(prompt_text) -> output text``.

    A prompt is recognised by its end (the generation prompt ``<|im_start|>assistant\\n``); from
    there the sequence follows the script prompt + encode(answer) + EOS (then ``filler``).
    """

    def __init__(self, tokenizer: Tokenizer, answer: Callable[[str], str], *, family: str = "qwen3_moe",
                 step_delay_s: float = 0.0, filler: int | None = None, eos: int = EOS) -> None:
        super().__init__({}, vocab_size=tokenizer.vocab_size, eos_token_ids=(eos,), step_delay_s=step_delay_s)
        self.config = ChatScriptedConfig(vocab_size=tokenizer.vocab_size, eos_token_ids=(eos,), family=family)
        self.tokenizer = tokenizer
        self.answer = answer
        self.eos = eos
        self.filler = eos if filler is None else filler
        self._marker = tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False)
        self._slot_scripts: dict[int, list[int]] = {}
        self.prompts: list[str] = []  # every prompt answered, as text

    def next_token(self, seq: int, fed: dict[int, int], n: int, *, is_new: bool) -> int:
        if is_new:
            self._slot_scripts.pop(seq, None)
        script = self._slot_scripts.get(seq)
        if script is None:
            tokens = [fed[i] for i in range(n)]
            if tokens[-len(self._marker):] == self._marker:
                prompt = self.tokenizer.decode(tokens, skip_special_tokens=False)
                self.prompts.append(prompt)
                out = self.tokenizer.encode(self.answer(prompt), add_special_tokens=False)
                script = self._slot_scripts[seq] = tokens + out + [self.eos]
        return script[n] if script is not None and n < len(script) else self.filler


def tools_tokenizer(root: Path, template: str = QWEN3_TOOL_TEMPLATE) -> Tokenizer:
    """The tiny test tokenizer with ``template`` (default: Qwen3-style, renders tools) as its chat template."""
    write_tiny_tokenizer(root)
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return Tokenizer(root)


def add_scripted_model(daemon: HttpDaemon, name: str, model: ChatScriptedModel, *, context_length: int = 1024,
                       max_batch: int = 4) -> LoadedEntry:
    """Serve ``model`` under ``name`` next to the loaded models (as if `moed load` had loaded it)."""
    runtime = ModelRuntime(loaded=None, model=model, executor=_NoExecutor(), tokenizer=model.tokenizer)
    loop = EngineLoop(runtime, name=name, max_batch=max_batch, context_length=context_length)
    entry = LoadedEntry(name, Path(name), runtime, loop, LoadOptions())
    loop.start()
    daemon.manager._models[name] = entry  # noqa: SLF001 - a test stand-in for a load
    return entry


def post_json(daemon: HttpDaemon, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON answer) of a POST with a JSON body, errors included (no SDK in between: any body goes)."""
    request = urllib.request.Request(daemon.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
