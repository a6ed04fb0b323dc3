"""EngineBridge: the one place HTTP code talks to the engine (model lookup, prompts, streamed generation).

The HTTP endpoints (OpenAI and Anthropic alike) only translate their wire formats; every engine
call they need goes through here, the same calls the gRPC ``InferenceServicer`` makes:
``ModelManager.get`` to pick a model, the model's own chat template and tokenizer to build the
prompt, ``EngineLoop.submit`` to queue it, ``RequestHandle.events`` / ``cancel`` to stream it.

Model names: a request's ``model`` is the name a loaded model is listed under (``GET /v1/models``,
``moed ps``), or, when the daemon loads on demand (``ctx.pool``), a name the catalog finds (``moed models``),
which ``acquire`` loads first. When exactly one model is loaded, an empty name or ``"default"`` also means
that model. A name found nowhere is a 404: a typo never silently runs a different model than the one asked
for.

Streams: the engine thread pushes ``StreamEvent``s into a thread-safe queue; a small pump thread
per request moves them onto the asyncio loop, so the event loop never blocks on the engine. When
the consumer stops iterating (client gone, generator closed, an error), the request is cancelled
and its KV slot freed at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moed.api.daemon_context import DaemonContext
from moed.api.http.access_log import AccessRecord, current_record
from moed.api.http.chat_request import ChatRequest, fold_system_messages, warn_dropped_media
from moed.api.http.error_status import ParamError
from moed.api.http.metrics import HttpMetrics
from moed.engine.model_manager import LoadedEntry
from moed.engine.model_pool import UNSET
from moed.engine.request import GenerationRequest, RequestHandle, StreamEvent
from moed.engine.sampling import MAX_SEED, ReasoningBudget, SamplingParams
from moed.errors import InvalidRequestError, ModelNotFoundError, ServiceUnavailableError, quoted
from moed.text.chat_template import template_renders_tool_calls
from moed.text.generic_tools import generic_messages
from moed.text.output_parser import (OutputParser, has_native_tools, output_parser_for, prompt_opens_reasoning,
                                     reasoning_tags)
from moed.text.stop_strings import StopMatcher
from moed.text.stream_decoder import StreamDecoder
from moed.text.tokenizer import Tokenizer
from moed.text.tool_grammar import MARKERS, after_reasoning, tool_call_grammar

DEFAULT_MODEL_ALIASES = ("", "default")  # mean "the one loaded model" when exactly one is loaded
log = logging.getLogger("moed.http")
PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to see whether it opened a reasoning block
PUMP_POLL_S = 1.0  # the pump thread re-checks whether its consumer left this often
DISCONNECT_CHECK_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP APIs list about one loaded model."""

    name: str
    family: str  # config.json model_type: "qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral", ...
    context_length: int  # prompt + generated tokens the model's engine loop serves
    created: int  # unix time the model was loaded


class GenerationStream:
    """One submitted request: iterate ``events()`` on the asyncio loop; ``cancel()`` from anywhere.

    Made by ``EngineBridge.open_stream`` (which submits at once, so a full queue or a bad prompt
    raises before any HTTP response has started). The events are the engine's ``StreamEvent``s;
    in raw mode their ``text`` is the output decoded with special tokens kept (see ``open_stream``).
    """

    def __init__(self, handle: RequestHandle, *, raw_decoder: StreamDecoder | None = None, eos_ids: frozenset[int] = frozenset(),
                 stop: tuple[str, ...] = (), on_done: Callable[[StreamEvent], None] | None = None) -> None:
        self.handle = handle
        self._on_done = on_done  # called with the done event (metrics)
        self.request_id = handle.request_id
        self.finish_reason = ""  # the done event's reason, once seen
        self._raw = raw_decoder
        self._eos_ids = eos_ids
        self._stop = StopMatcher(stop) if raw_decoder is not None else None
        self._stopped_by_raw_stop = False
        self._left = threading.Event()  # the consumer is gone: the pump may end
        self._started = False
        self._done = False
        self.access: AccessRecord | None = None  # the HTTP request's access-log record, when there is one

    def cancel(self) -> bool:
        """Ask the engine to stop this request (idempotent; False when it had already finished)."""
        return self.handle.cancel()

    async def events(self, *, heartbeat_s: float | None = None,
                     is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                     ) -> AsyncIterator[StreamEvent | None]:
        """Yield the request's events, ending after the done event (``done=True``, finish reason, usage).

        ``heartbeat_s``: when no event came for that long, yield ``None`` (a chance to send an SSE
        ping or comment while the model is silent, e.g. during a long prefill).
        ``is_disconnected`` (e.g. starlette's ``request.is_disconnected``; for non-streamed answers,
        where nothing else watches the connection) is checked every DISCONNECT_CHECK_S: a client
        that left cancels the request and ends the iteration. Leaving the loop early in any way
        (break, exception, ``aclose``, task cancellation) cancels the request.
        """
        if self._started:
            raise RuntimeError(f"request {self.request_id!r}: events() can be iterated only once")
        self._started = True
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()
        threading.Thread(target=self._pump, args=(loop, queue), name=f"moed-http-{self.request_id[:16]}",
                         daemon=True).start()
        now = loop.time()
        silent_until = now + heartbeat_s if heartbeat_s is not None else None
        check_at = now + DISCONNECT_CHECK_S if is_disconnected is not None else None
        try:
            while True:
                due = [t for t in (silent_until, check_at) if t is not None]
                try:
                    if due:  # Queue.get is cancel-safe: a timed-out get loses nothing
                        item = await asyncio.wait_for(queue.get(), max(0.0, min(due) - loop.time()))
                    else:
                        item = await queue.get()
                except asyncio.TimeoutError:
                    item = None
                now = loop.time()
                if check_at is not None and now >= check_at:
                    check_at = now + DISCONNECT_CHECK_S
                    if await is_disconnected():
                        return
                if item is None:
                    if silent_until is not None and now >= silent_until:
                        silent_until = now + heartbeat_s
                        yield None
                    continue
                if silent_until is not None:
                    silent_until = now + heartbeat_s
                if isinstance(item, BaseException):
                    raise item
                if self.access is not None and not item.done:  # so far (the done event has the totals)
                    self.access.generated_tokens = (self.access.generated_tokens or 0) + len(item.token_ids)
                if item.done:
                    self._done = True
                    self.finish_reason = item.finish_reason
                    if self._on_done is not None:
                        self._on_done(item)
                yield item
                if item.done:
                    return
        finally:
            self._left.set()
            if not self._done:
                self.handle.cancel()

    # ---- the pump thread ----

    def _pump(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        """Move events from the engine's handle onto the asyncio queue (raw-decoding them on the way)."""

        def put(item: StreamEvent | BaseException) -> bool:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
                return True
            except RuntimeError:  # the event loop closed (server stopping): nobody is listening any more
                return False

        try:
            while not self._left.is_set():
                try:
                    for event in self.handle.events(timeout=PUMP_POLL_S):
                        if self._raw is not None:
                            event = self._raw_event(event)
                        if not put(event) or event.done:
                            return
                    return
                except TimeoutError:
                    continue  # nothing yet: check whether the consumer is still there
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it (and cancels)
            put(exc)

    def _raw_event(self, event: StreamEvent) -> StreamEvent:
        """The event with its text decoded from its token ids, special tokens kept (EOS excluded)."""
        if event.done:
            text = "" if self._stop.stopped else self._stop.push(self._raw.flush())[0] + self._stop.flush()
            reason = event.finish_reason
            if self._stopped_by_raw_stop and reason in ("cancelled", "eos", "length", "context", "deadline"):
                reason = "stop"  # what ended the text here was the stop string, whatever the engine saw next
            return dataclasses.replace(event, text=text, finish_reason=reason)
        if self._stop.stopped:
            return dataclasses.replace(event, text="")
        ids = [t for t in event.token_ids if t not in self._eos_ids]
        text, hit = self._stop.push(self._raw.add_many(ids) if ids else "")
        if hit:
            # the engine matches stop strings on text without special tokens; here they were kept, so the
            # stop may show up first in this text: end the request here all the same
            self._stopped_by_raw_stop = True
            self.handle.cancel()
        return dataclasses.replace(event, text=text)


def with_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with an assistant tool-call turn's ``reasoning_content`` also as ``thinking``.

    Templates differ in where they read earlier reasoning: Qwen3's reads ``reasoning_content``,
    gpt-oss's reads ``thinking``, and only for tool-call turns, which is where its reasoning must be
    shown again; it refuses a tool-call turn with both text and thinking, so a turn with text is
    left as it is (that template shows the text as the reasoning then)."""
    out = []
    for m in messages:
        if (m.get("role") == "assistant" and m.get("tool_calls") and m.get("reasoning_content")
                and not m.get("content") and "thinking" not in m):
            m = {**m, "thinking": m["reasoning_content"]}
        out.append(m)
    return out


@dataclass
class PreparedChat:
    """A submitted chat request (``EngineBridge.prepare_chat``): iterate ``stream`` through ``parser``."""

    prompt_ids: list[int]
    params: SamplingParams
    parser: OutputParser
    stream: GenerationStream
    generic_tools: bool  # tools were offered in the generic format


class EngineBridge:
    """Engine access for the HTTP endpoints; methods raise ``MoedError``s with messages for people."""

    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self.metrics = HttpMetrics()
        self._native_tools: dict[int, tuple[LoadedEntry, bool]] = {}

    # ---- models ----

    def resolve(self, model: str | None) -> LoadedEntry:
        """The loaded model a request names (see the module docstring for the rules).

        Raises ServiceUnavailableError (paused, loading, stopping), ModelNotFoundError (not loaded)
        or InvalidRequestError (several loaded and none named).
        """
        if self.ctx.stopping:
            raise ServiceUnavailableError("the daemon is shutting down")
        if self.ctx.paused:
            raise ServiceUnavailableError("serving is paused; resume it from the tray")
        name = model or ""
        if not isinstance(name, str):
            raise InvalidRequestError(f"model must be a string, got {quoted(model)}")
        loaded = {e.name: e for e in self.ctx.manager.loaded()}
        if name in loaded:
            return self.ctx.manager.get(name)
        if not loaded:
            # a named model while the daemon loads on demand: not an error here, acquire() shares the load in flight
            # (a request arriving while another request's load of the first model runs used to get this 503)
            on_demand = self.ctx.pool is not None and bool(name) and name not in DEFAULT_MODEL_ALIASES
            if self.ctx.manager.is_loading and not on_demand:
                raise ServiceUnavailableError("a model is still loading; retry when `GET /health` says ok")
            raise ModelNotFoundError(f"model {quoted(name)}: no model is loaded; load one with `moed load MODEL` "
                                     "or start the daemon with `moed serve --model MODEL`")
        if name in DEFAULT_MODEL_ALIASES:
            if len(loaded) == 1:
                return self.ctx.manager.get(next(iter(loaded)))
            raise InvalidRequestError(f"several models are loaded ({', '.join(sorted(loaded))}); "
                                      "name one in the request's 'model' field")
        raise ModelNotFoundError(f"model {quoted(name)} is not loaded (loaded: {', '.join(sorted(loaded))}); "
                                 "use one of these names (GET /v1/models lists them) or load it with `moed load`")

    async def acquire(self, model: str | None, *, keep_alive: Any = UNSET, context_length: int | None = None,
                      load_only: bool = False) -> LoadedEntry:
        """The model a request names, loaded first when the daemon loads on demand (``ctx.pool``, see
        ``engine/model_pool.py``): the request waits for the load (one load per model, however many requests
        wait), up to the pool's bound, then gets a 503 with Retry-After. ``keep_alive`` (seconds, None =
        forever) applies to that model from this request on; ``context_length``: the context a load this request
        starts gets (Ollama's num_ctx); ``load_only``: no generation follows (keep_alive 0 then unloads at once)."""
        pool = self.ctx.pool
        try:
            entry = self.resolve(model)
        except ModelNotFoundError:
            if pool is None or not isinstance(model, str) or model in DEFAULT_MODEL_ALIASES:
                raise
            options = None if context_length is None else dataclasses.replace(pool.config.options,
                                                                              context_length=context_length)
            try:
                future = pool.start_load(model, options)
            except InvalidRequestError as missing:
                raise ModelNotFoundError(str(missing)) from None
            try:
                entry = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), pool.config.load_wait_s)
            except asyncio.TimeoutError:
                raise ServiceUnavailableError(
                    f"model {quoted(model)} is still loading; retry in a few seconds (`moed ps` shows the load)",
                    retry_after=5) from None
        if pool is not None:
            pool.touch(entry.name, keep_alive, hold=not load_only)
        return entry

    def models(self) -> list[ModelInfo]:
        """Every loaded model, sorted by name."""
        return [self.model_info(e) for e in sorted(self.ctx.manager.loaded(), key=lambda e: e.name)]

    @staticmethod
    def model_info(entry: LoadedEntry) -> ModelInfo:
        return ModelInfo(name=entry.name, family=EngineBridge.family(entry),
                         context_length=entry.loop.context_length, created=int(entry.loaded_at))

    @staticmethod
    def family(entry: LoadedEntry) -> str:
        """The model's family (config.json model_type)."""
        return entry.runtime.model.config.family

    @staticmethod
    def tool_format(entry: LoadedEntry) -> str:
        """How the model writes tool calls and reasoning (its family's format), which picks its output parser."""
        return entry.runtime.tool_format

    @staticmethod
    def tokenizer(entry: LoadedEntry) -> Tokenizer:
        tokenizer = entry.runtime.tokenizer
        if tokenizer is None:  # the manager refuses such loads; a guard for hand-made entries
            raise InvalidRequestError(f"model {quoted(entry.name)} has no tokenizer; it cannot serve text")
        return tokenizer

    # ---- prompts ----

    def render_chat(self, entry: LoadedEntry, messages: list[dict[str, Any]], *,
                    tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                    **template_variables: Any) -> list[int]:
        """Prompt ids for chat messages (and tools) rendered by the model's own chat template.

        ``messages`` are HF-style dicts: ``{"role", "content"}``, assistant ``tool_calls``
        (``[{"id", "type": "function", "function": {"name", "arguments": dict}}]``), tool results
        ``{"role": "tool", "tool_call_id", "content"}``. ``tools`` are OpenAI-style
        ``{"type": "function", "function": {"name", "description", "parameters"}}`` objects, passed
        as the template's ``tools`` variable (None or [] = none rendered). Extra keyword arguments
        become template variables (e.g. ``enable_thinking=False``, ``reasoning_effort="low"``).
        """
        return self.tokenizer(entry).encode(
            self.render_chat_text(entry, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  **template_variables),
            add_special_tokens=False)  # the template wrote any BOS it wants

    def render_chat_text(self, entry: LoadedEntry, messages: list[dict[str, Any]], *,
                         tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                         **template_variables: Any) -> str:
        """The rendered prompt text (what ``render_chat`` encodes)."""
        return self.tokenizer(entry).apply_chat_template(with_thinking(messages),
                                                         add_generation_prompt=add_generation_prompt,
                                                         tools=tools or None, **template_variables)

    def encode(self, entry: LoadedEntry, text: str) -> list[int]:
        """Prompt ids for a plain (completion) prompt, with the tokenizer's own BOS handling."""
        if not isinstance(text, str) or not text:
            raise InvalidRequestError("the prompt is empty; give at least one character of text")
        return self.tokenizer(entry).encode(text)

    def count_tokens(self, entry: LoadedEntry, messages: list[dict[str, Any]], *,
                     tools: list[dict[str, Any]] | None = None, **template_variables: Any) -> int:
        """How many prompt tokens these messages (and tools) take, generation prompt included."""
        return len(self.render_chat(entry, messages, tools=tools, **template_variables))

    def check_prompt_fits(self, entry: LoadedEntry, prompt_ids: Sequence[int]) -> None:
        """ParamError (code context_length_exceeded) when the prompt leaves no room for one output token.

        The wording is Anthropic's ("prompt is too long: N tokens > M maximum") and the code
        OpenAI's: agents (Claude Code, OpenCode, Codex) recognise these and compact the conversation."""
        context = entry.loop.context_length
        if len(prompt_ids) >= context:
            raise ParamError(
                f"prompt is too long: {len(prompt_ids)} tokens > {context - 1} maximum (model {quoted(entry.name)} "
                f"serves a context of {context} tokens, the prompt plus at least one generated token); shorten the "
                "prompt or compact the conversation", code="context_length_exceeded")

    def default_max_tokens(self, entry: LoadedEntry, prompt_ids: list[int]) -> int:
        """The output budget when a request gives none: the rest of the context (at least 1)."""
        return max(1, entry.loop.context_length - len(prompt_ids))

    # ---- tools and output parsing ----

    def has_native_tools(self, entry: LoadedEntry) -> bool:
        """Whether the model's output format has a tool-call syntax and its chat template renders tools
        (else tools go through the generic format, ``moed.text.generic_tools``). Cached per model."""
        key = id(entry)
        known = self._native_tools.get(key)
        if known is None or known[0] is not entry:
            known = (entry, has_native_tools(self.tool_format(entry), self.tokenizer(entry).tool_chat_template))
            self._native_tools[key] = known
        return known[1]

    def renders_tool_calls(self, entry: LoadedEntry) -> bool:
        """Whether the model's template shows earlier tool calls and results without a tools list."""
        return template_renders_tool_calls(self.tokenizer(entry).chat_template)

    def output_parser(self, entry: LoadedEntry, *, tools: bool | Sequence[dict[str, Any]],
                      prompt_ids: Sequence[int] | None = None, stream: bool = True,
                      generic_tools: bool = False) -> OutputParser:
        """A fresh streaming parser for one answer of this model: ``feed(text) -> [OutputEvent]``, ``finish()``.

        OutputEvent.kind is "text", "reasoning" or "tool_call" (``tool_index``, ``tool_id``,
        ``name`` on a call's first event, then ``arguments_delta`` JSON pieces); see
        ``moed.text.output_parser``. ``tools``: the request's tools (OpenAI-style dicts, or
        Anthropic-style ``{"name", ...}``; a call to a name not among them stays text) or just
        whether there are any; their parameter schemas type the raw values of XML calls
        (Qwen3-Coder). ``prompt_ids``: the prompt, so that an answer that starts inside a
        reasoning block the template opened (``...<think>\n``) is parsed as reasoning. Feed it
        the text of a stream opened with ``raw=True``: parsers read special tokens. ``stream=False``
        (a whole answer): a call goes out only once complete, so one the model broke off stays text.
        """
        names, parameters = None, None
        if not isinstance(tools, bool):
            functions = [t.get("function", t) for t in tools]
            names = [f.get("name") for f in functions if isinstance(f.get("name"), str)]
            parameters = {f["name"]: f.get("parameters", f.get("input_schema")) for f in functions
                          if isinstance(f.get("name"), str)}
        opens = False
        if prompt_ids:
            tail = self.tokenizer(entry).decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
            opens = prompt_opens_reasoning(self.tool_format(entry), tail)
        end_tokens = ()
        if generic_tools:
            tokenizer = self.tokenizer(entry)
            end_tokens = tuple(t for t in (tokenizer.id_to_token(i) for i in tokenizer.eos_token_ids) if t)
        return output_parser_for(self.tool_format(entry), tools=bool(tools), starts_in_reasoning=opens, tool_names=names,
                                 tool_parameters=parameters, stream_arguments=stream, generic_tools=generic_tools,
                                 end_tokens=end_tokens)

    @staticmethod
    def parser_wants_raw(parser: OutputParser) -> bool:
        """Open a parser's stream with ``raw=`` this: True, since every family's parser reads the text
        with special tokens kept (gpt-oss's ``<|channel|>``, Mistral's ``[TOOL_CALLS]`` are special
        tokens) and drops end-of-turn tokens itself."""
        return True

    # ---- one chat request, whichever API it came through ----

    def chat_prompt(self, entry: LoadedEntry, chat: ChatRequest) -> tuple[list[int], bool]:
        """(prompt ids, whether tools went in the generic format) for a chat request: system messages
        folded, tools in the model's own syntax or the generic one, a prefill cut after its text."""
        messages = fold_system_messages(chat.messages)
        tools = list(chat.tools)
        generic = bool(tools) and not self.has_native_tools(entry)
        if generic or (not tools and not self.renders_tool_calls(entry)):
            # without tools too: earlier calls and results must become text a template without tool syntax shows
            messages, tools = generic_messages(messages, tools), []
        variables = chat.template_variables
        if not chat.prefill:
            return self.render_chat(entry, messages, tools=tools, **variables), generic
        prefill = messages[-1].get("content") or ""
        if prefill != prefill.rstrip():
            raise ParamError("the final assistant turn (a prefill) ends with whitespace; remove the trailing "
                             "whitespace", "messages")
        text = self.render_chat_text(entry, messages, tools=tools, add_generation_prompt=False, **variables)
        cut = text.rfind(prefill)
        if cut < 0:
            raise ParamError("the model's chat template does not show the final assistant turn's text, so moed "
                             "cannot continue it; end the conversation with a user turn", "messages")
        ids = self.tokenizer(entry).encode(text[: cut + len(prefill)], add_special_tokens=False)
        return ids, generic

    def prepare_chat(self, entry: LoadedEntry, chat: ChatRequest) -> "PreparedChat":
        """Render, check and submit a chat request: its prompt, parameters, output parser and open stream.

        The output budget is ``chat.max_tokens`` or the rest of the context, and never more than the
        rest of the context: agents ask for 32k tokens by default, which a local model's context
        may not hold after their prompt (llama-server also clamps)."""
        warn_dropped_media(chat.dropped_media, entry.name)
        prompt_ids, generic = self.chat_prompt(entry, chat)
        self.check_prompt_fits(entry, prompt_ids)
        room = self.default_max_tokens(entry, prompt_ids)
        params = dataclasses.replace(chat.params, max_tokens=min(chat.max_tokens or room, room))
        if chat.forced_tools and chat.tools:
            params = self.force_tool_calls(entry, chat, params, prompt_ids, generic)
        elif params.grammar is not None and not generic:
            tags = reasoning_tags(self.tool_format(entry))
            if tags is not None:  # the schema applies to the answer after the reasoning block
                params = dataclasses.replace(params, grammar=after_reasoning(
                    params.grammar, tags, self.reasoning_state(entry, prompt_ids)))
        if chat.reasoning_budget is not None and not generic:
            params = self.budget_reasoning(entry, chat.reasoning_budget, params, prompt_ids)
        parser = self.output_parser(entry, tools=chat.tools, prompt_ids=prompt_ids, stream=chat.stream,
                                    generic_tools=generic)
        stream = self.open_stream(entry, prompt_ids, params, raw=True)
        return PreparedChat(prompt_ids, params, parser, stream, generic)

    def force_tool_calls(self, entry: LoadedEntry, chat: ChatRequest, params: SamplingParams,
                         prompt_ids: Sequence[int], generic: bool) -> SamplingParams:
        """A forced tool choice as a grammar of calls in the model's syntax (``text/tool_grammar.py``); where moed
        has none for that syntax, the request only asks for a call (logged)."""
        if params.grammar is not None:
            raise ParamError("a forced tool_choice and a structured-output format cannot both constrain one answer; "
                             "drop one of them", "tool_choice")
        fmt = "generic" if generic else self.tool_format(entry)
        tokenizer = self.tokenizer(entry)
        xml = not generic and "<function=" in (tokenizer.chat_template or "")
        reasoning = "none" if generic else self.reasoning_state(entry, prompt_ids)
        template = tokenizer.chat_template or ""
        special = {t: i for t in MARKERS if (i := tokenizer.token_to_id(t)) is not None
                   and i in tokenizer.special_token_ids}
        grammar = tool_call_grammar(fmt, chat.tools, parallel=chat.parallel_tool_calls, reasoning=reasoning,
                                    xml_calls=xml, dsml_block="function_calls" if "function_calls>" in template
                                    else "tool_calls", deepseek_v31="```json" not in template, special=special)
        if grammar is None:
            log.info("model %s: a forced tool_choice is asked for, not enforced (no call grammar for its %s "
                     "tool syntax yet)", entry.name, "XML" if xml else fmt)
            return params
        return dataclasses.replace(params, grammar=grammar)

    def reasoning_state(self, entry: LoadedEntry, prompt_ids: Sequence[int]) -> str:
        """How the answer meets the family's reasoning block: "open" (the prompt opened it), "none" (the prompt
        closed it: thinking off) or "optional" (the model may open one)."""
        tail = self.tokenizer(entry).decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        tags = reasoning_tags(self.tool_format(entry))
        if tags is None or tail.rstrip().endswith(tags[1]):
            return "none"
        return "open" if prompt_opens_reasoning(self.tool_format(entry), tail) else "optional"

    def budget_reasoning(self, entry: LoadedEntry, budget: int, params: SamplingParams,
                         prompt_ids: Sequence[int]) -> SamplingParams:
        """A thinking budget as the engine enforces it: the family's closing tag forced once ``budget`` tokens of
        reasoning were written; a family without reasoning tags (harmony's channels) is not limited (logged)."""
        fmt = self.tool_format(entry)
        tags = reasoning_tags(fmt)
        if tags is None:
            log.info("model %s: a thinking budget is not enforced for its %s output format", entry.name, fmt)
            return params
        tokenizer = self.tokenizer(entry)
        tail = tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        rb = ReasoningBudget(budget, tuple(tokenizer.encode(tags[0], add_special_tokens=False)),
                             tuple(tokenizer.encode(tags[1], add_special_tokens=False)),
                             starts_open=prompt_opens_reasoning(fmt, tail))
        return dataclasses.replace(params, reasoning_budget=rb)

    def prepare_more(self, entry: LoadedEntry, chat: ChatRequest, first: "PreparedChat", index: int) -> "PreparedChat":
        """Choice ``index`` (n > 1) of a prepared chat: the same prompt and parameters (a given seed + index), its
        own parser and stream. Submitted once the first choice's prompt is in the prefix cache, it prefills only
        what no block holds yet."""
        params = first.params if first.params.seed is None else dataclasses.replace(
            first.params, seed=(first.params.seed + index) % (MAX_SEED + 1))
        parser = self.output_parser(entry, tools=chat.tools, prompt_ids=first.prompt_ids, stream=chat.stream,
                                    generic_tools=first.generic_tools)
        return PreparedChat(first.prompt_ids, params, parser, self.open_stream(entry, first.prompt_ids, params, raw=True),
                            first.generic_tools)

    # ---- generation ----

    def open_stream(self, entry: LoadedEntry, prompt_ids: list[int], params: SamplingParams, *,
                    request_id: str | None = None, deadline: float | None = None,
                    raw: bool = False) -> GenerationStream:
        """Submit a request now (raises InvalidRequestError / QueueFullError / ServiceUnavailableError
        before anything is queued) and return its stream; iterate ``stream.events()`` on the loop.

        ``raw=True``: event texts are decoded from the token ids with special tokens kept (the
        engine's own text skips them, but tool/reasoning markers of some families, e.g. gpt-oss's
        ``<|channel|>``, are special tokens); EOS tokens are left out, and stop strings are matched
        on this text too. ``deadline`` is a ``time.monotonic()`` instant.
        """
        if self.ctx.stopping:
            raise ServiceUnavailableError("the daemon is shutting down")
        if self.ctx.paused:
            raise ServiceUnavailableError("serving is paused; resume it from the tray")
        self.check_prompt_fits(entry, prompt_ids)
        request_id = request_id or uuid.uuid4().hex
        handle = entry.loop.submit(GenerationRequest(request_id, list(prompt_ids), params, deadline))
        name = entry.name
        record = current_record()
        if record is not None:
            record.model, record.prompt_tokens = name, len(prompt_ids)

        def on_done(event: StreamEvent) -> None:
            usage = event.usage
            if record is not None:
                record.finish = event.finish_reason
                if usage is not None:
                    record.cached_tokens, record.generated_tokens = usage.cached_tokens, usage.completion_tokens
                    record.ttft_s = usage.ttft_s if usage.completion_tokens else None
            self.metrics.observe_done(name, event.finish_reason, usage.prompt_tokens if usage else len(prompt_ids),
                                      usage.completion_tokens if usage else 0)

        if not raw:
            stream = GenerationStream(handle, on_done=on_done)
        else:
            tokenizer = self.tokenizer(entry)
            eos = frozenset() if params.ignore_eos else frozenset(
                set(entry.runtime.model.config.eos_token_ids) | set(tokenizer.eos_token_ids))
            stream = GenerationStream(handle, raw_decoder=tokenizer.stream_decoder(prompt_ids, skip_special_tokens=False),
                                      eos_ids=eos, stop=params.stop, on_done=on_done)
        stream.access = record
        return stream

    async def stream(self, entry: LoadedEntry, prompt_ids: list[int], params: SamplingParams, *,
                     request_id: str | None = None, deadline: float | None = None, raw: bool = False,
                     heartbeat_s: float | None = None,
                     is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                     ) -> AsyncIterator[StreamEvent | None]:
        """``open_stream`` + ``events()`` in one: submits on the first iteration, so errors surface there."""
        stream = self.open_stream(entry, prompt_ids, params, request_id=request_id, deadline=deadline, raw=raw)
        events = stream.events(heartbeat_s=heartbeat_s, is_disconnected=is_disconnected)
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

