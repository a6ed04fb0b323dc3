"""Renders a model's Jinja chat template exactly like transformers' apply_chat_template, in a sandbox."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moed.errors import InvalidRequestError, ModelFormatError, MoedError, quoted

NO_TEMPLATE_MESSAGE = "model has no chat template; use plain prompt mode (omit --chat)"
# Variables render_chat sets itself; extra template variables may not override them.
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class _TemplateRejected(jinja2.exceptions.TemplateError):
    """raise_exception() from inside a template: the template judged the conversation invalid."""


def _raise_exception(message: str) -> None:
    raise _TemplateRejected(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would change tool schemas in the prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # Templates call dict(...); a plain callable avoids exposing the dict type (and its attributes) to them.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace are a known route to CPython internals; refuse them.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Templates come from downloaded model repos: untrusted code, hence the immutable sandbox.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def require_chat_template(template: str | None) -> str:
    """The template, or InvalidRequestError telling the user to use plain prompt mode."""
    if not template:
        raise InvalidRequestError(NO_TEMPLATE_MESSAGE)
    return template


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        texts = []
        for j, part in enumerate(content):
            is_text = isinstance(part, Mapping) and part.get("type", "text") == "text"
            if not (is_text and isinstance(part.get("text"), str)):
                raise InvalidRequestError(
                    f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': '...'}}, got {quoted(part)}; "
                    "only text content is supported."
                )
            texts.append(part["text"])
        # Most templates concatenate content as a string, so flatten the parts like vLLM's "string" format.
        return "\n".join(texts)
    raise InvalidRequestError(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}."
    )


def _plain(value: Any, where: str) -> Any:
    # The template only ever sees JSON-shaped data: rich objects could expose methods to the sandbox.
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise InvalidRequestError(f"{where} contains a {type(value).__name__}; only JSON values are allowed.")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Checked, plain-JSON copies of the messages (None-valued keys dropped, as transformers does)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} objects; "
            f"got {'an empty list' if isinstance(messages, list) else type(messages).__name__}."
        )
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content', got {type(msg).__name__}.")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where}.role must be a non-empty string such as 'user', got {quoted(role)}.")
        clean = {k: _plain(v, f"{where}.{k}") for k, v in msg.items() if v is not None}
        if "content" in clean:
            clean["content"] = _content_text(msg["content"], where)
        elif not (role == "assistant" and clean.get("tool_calls")):
            # Only an assistant message that carries tool calls may omit its text.
            raise InvalidRequestError(f"{where} ({role}) has no 'content'; give a string (may be empty).")
        out.append(clean)
    return out


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_source: str = "tokenizer_config.json",
    **extra: Any,
) -> str:
    """The prompt text for messages; same output as transformers' apply_chat_template(tokenize=False).

    Raises InvalidRequestError for bad messages or when the template itself rejects the conversation
    (raise_exception, e.g. roles that do not alternate), ModelFormatError when the template is broken.
    """
    template = require_chat_template(template)
    chat = validate_messages(messages)
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)):
        raise InvalidRequestError("tools must be a list of JSON-schema objects.")
    reserved = sorted(_RESERVED_VARIABLES & extra.keys())
    if reserved:
        raise InvalidRequestError(f"template variables {reserved} are reserved; pass them as arguments instead.")
    variables = {k: _plain(v, k) for k, v in extra.items()}
    # transformers only defines special-token variables that are set; None would render as the text "None".
    for name, token in (("bos_token", bos_token), ("eos_token", eos_token)):
        if token is not None:
            variables[name] = token
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=chat,
            tools=None if tools is None else _plain(tools, "tools"),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except MoedError:
        raise
    except _TemplateRejected as exc:
        raise InvalidRequestError(f"the model's chat template rejected the conversation: {exc}") from exc
    except Exception as exc:  # syntax errors, undefined names, type errors inside the template
        raise ModelFormatError(
            f"the chat template in {template_source} failed: {type(exc).__name__}: {exc}. "
            "The template is broken or needs inputs moed does not provide; fix the template "
            "or use plain prompt mode (omit --chat)."
        ) from exc


_PROBE_TOOL_NAME = "moed_probe_tool_5c1e"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_TOOL_NAME, "description": "Checks whether the chat template renders tools.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]


@functools.lru_cache(maxsize=32)
def template_renders_tools(template: str | None) -> bool:
    """Whether the template puts the ``tools`` it is given into the prompt.

    Renders a short conversation with a probe tool (with and without a system message, since some
    templates insist on one) and looks for the probe's name; a template that fails to render
    with tools, or ignores them, cannot offer tools to the model.
    """
    if not template:
        return False
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]):
        try:
            prompt = render_chat(template, messages, tools=_PROBE_TOOLS, bos_token="", eos_token="")
        except MoedError:
            continue
        return _PROBE_TOOL_NAME in prompt
    return False


@functools.lru_cache(maxsize=32)
def template_renders_tool_calls(template: str | None) -> bool:
    """Whether the template shows an assistant turn's ``tool_calls`` and a ``tool`` result (some templates
    that take no ``tools`` list still render a conversation's earlier calls); see ``template_renders_tools``."""
    if not template:
        return False
    call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_TOOL_NAME, "arguments": {"x": "1"}}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_probe", "name": _PROBE_TOOL_NAME, "content": "probe-result-7"}]
    try:
        prompt = render_chat(template, messages, bos_token="", eos_token="")
    except MoedError:
        return False
    return _PROBE_TOOL_NAME in prompt and "probe-result-7" in prompt
