"""The settings that point Claude Code, OpenCode and Codex CLI at moed, and merging them into their files.

Each agent gets a pure function pair: what to print (shell exports or a snippet) and how to merge
the settings into the text of its existing config file, keeping every unrelated setting. The
merges return the new text and one line per changed value; ``moed launch`` writes the file.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from typing import Any

from moed.errors import InvalidRequestError

PROVIDER_ID = "moed"  # the provider's key in opencode.json and Codex's config.toml
PLACEHOLDER_TOKEN = "moed"  # Claude Code wants some token; a daemon without one ignores it
CODEX_KEY_ENV = "MOED_API_KEY"  # Codex reads a provider's key from the environment variable it names
CLAUDE_TIMEOUT_MS = "3000000"  # 50 min: a long prefill on a big local model outlasts the 10-min default


@dataclass(frozen=True)
class AgentTarget:
    url: str  # the HTTP server, e.g. http://127.0.0.1:8080 (no trailing slash, no /v1)
    model: str
    context: int | None = None  # context length in tokens, when known
    max_output: int | None = None  # max output tokens the agent should ask for
    token: str | None = None  # the daemon's token, when it has one

    @property
    def v1_url(self) -> str:
        return self.url + "/v1"


def _shown(value: Any, *, secret: str | None) -> str:
    if secret and value == secret:
        return '"****"'
    return json.dumps(value, ensure_ascii=False)


def _change(key: str, old: Any, new: Any, *, secret: str | None) -> str:
    if old is None:
        return f"{key} = {_shown(new, secret=secret)} (new)"
    return f"{key} = {_shown(new, secret=secret)} (was {_shown(old, secret=secret)})"


def _load_json_object(text: str | None, where: str) -> dict[str, Any]:
    if text is None or not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where} is not valid JSON ({exc}); fix it (or move it away) and run again. "
                                  "Nothing was written.") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{where} must hold a JSON object, not {type(data).__name__}; nothing was written.")
    return data


def _dump_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


# -- Claude Code --------------------------------------------------------------------------------
def claude_env(t: AgentTarget) -> dict[str, str]:
    """Claude Code's environment: the Anthropic API at moed, every model alias mapped to the model;
    with a known context, the output budget Claude Code asks for kept inside it (its default, 32k
    tokens, is more than a local model's context holds, which moed refuses with a 400)."""
    env = {
        "ANTHROPIC_BASE_URL": t.url,  # Claude Code appends /v1/messages itself
        "ANTHROPIC_AUTH_TOKEN": t.token or PLACEHOLDER_TOKEN,  # sent as Authorization: Bearer
        "ANTHROPIC_MODEL": t.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,  # background tasks
        "ANTHROPIC_SMALL_FAST_MODEL": t.model,  # the older name of the haiku variable
        "API_TIMEOUT_MS": CLAUDE_TIMEOUT_MS,
        # Claude Code puts "x-anthropic-billing-header: cc_version=...; cch=...;" first in the system prompt,
        # different in every request; with it no two requests share a prefix (moed also strips it)
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        # no telemetry, error reports or update checks: a local setup has nobody to send them to
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    if t.context:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(t.max_output or default_max_output(t.context))
        # compact before the model's context is full (Claude Code takes no window under 100k tokens here:
        # below that it compacts when moed answers "prompt is too long")
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(t.context)
    return env


def claude_exports(t: AgentTarget) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in claude_env(t).items())


def merge_claude_settings(text: str | None, t: AgentTarget, where: str) -> tuple[str, list[str]]:
    """~/.claude/settings.json with our variables in its "env" object; other keys kept."""
    data = _load_json_object(text, where)
    env = data.get("env", {})
    if not isinstance(env, dict):
        raise InvalidRequestError(f'{where}: "env" must be an object, not {type(env).__name__}; nothing was written.')
    changes = []
    for key, value in claude_env(t).items():
        if env.get(key) != value:
            changes.append(_change(f"env.{key}", env.get(key), value, secret=t.token))
            env[key] = value
    data["env"] = env
    return _dump_json(data), changes


# -- OpenCode -----------------------------------------------------------------------------------
def opencode_model_entry(t: AgentTarget) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": f"{t.model} (moed)"}
    if t.context:
        entry["limit"] = {"context": t.context, "output": t.max_output or default_max_output(t.context)}
    return entry


def default_max_output(context: int) -> int:
    """A quarter of the context (at most 32k): room for the agent's long prompts."""
    return max(1, min(context // 4, 32768))


def opencode_config(t: AgentTarget) -> dict[str, Any]:
    """The opencode.json fragment: an OpenAI-compatible provider "moed" and the default model."""
    options: dict[str, Any] = {"baseURL": t.v1_url}
    if t.token:
        options["apiKey"] = t.token
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "moed (local)", "options": options,
                "models": {t.model: opencode_model_entry(t)}}
    return {"provider": {PROVIDER_ID: provider}, "model": f"{PROVIDER_ID}/{t.model}"}


def merge_opencode_config(text: str | None, t: AgentTarget, where: str) -> tuple[str, list[str]]:
    """opencode.json with provider "moed" (other providers, and other models of it, kept) and model set."""
    data = _load_json_object(text, where)
    ours = opencode_config(t)
    changes = []
    if not data:
        data["$schema"] = "https://opencode.ai/config.json"
    providers = data.setdefault("provider", {})
    if not isinstance(providers, dict):
        raise InvalidRequestError(f'{where}: "provider" must be an object; nothing was written.')
    provider = providers.setdefault(PROVIDER_ID, {})
    if not isinstance(provider, dict):
        raise InvalidRequestError(f'{where}: "provider.{PROVIDER_ID}" must be an object; nothing was written.')
    new = ours["provider"][PROVIDER_ID]
    for key in ("npm", "name"):
        if provider.get(key) != new[key]:
            changes.append(_change(f"provider.{PROVIDER_ID}.{key}", provider.get(key), new[key], secret=t.token))
            provider[key] = new[key]
    for field in ("options", "models"):
        current = provider.setdefault(field, {})
        if not isinstance(current, dict):
            raise InvalidRequestError(f'{where}: "provider.{PROVIDER_ID}.{field}" must be an object; '
                                      "nothing was written.")
        for key, value in new[field].items():
            if current.get(key) != value:
                changes.append(_change(f"provider.{PROVIDER_ID}.{field}.{key}", current.get(key), value,
                                       secret=t.token))
                current[key] = value
    if data.get("model") != ours["model"]:
        changes.append(_change("model", data.get("model"), ours["model"], secret=t.token))
        data["model"] = ours["model"]
    return _dump_json(data), changes


# -- Codex CLI ----------------------------------------------------------------------------------
def codex_values(t: AgentTarget) -> tuple[dict[str, Any], dict[str, Any]]:
    """(top-level keys, the [model_providers.moed] table) for Codex's config.toml."""
    top: dict[str, Any] = {"model": t.model, "model_provider": PROVIDER_ID}
    if t.context:
        top["model_context_window"] = t.context
        top["model_auto_compact_token_limit"] = t.context * 9 // 10  # compact before the context is full
    # a long prefill on a big local model sends nothing for minutes: wait as long as Claude Code does
    table: dict[str, Any] = {"name": "moed (local)", "base_url": t.v1_url, "wire_api": "responses",
                             "stream_idle_timeout_ms": int(CLAUDE_TIMEOUT_MS)}
    if t.token:
        table["env_key"] = CODEX_KEY_ENV
    return top, table


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, ensure_ascii=False)  # a TOML basic string: JSON's escapes minus \/, never emitted


def _toml_lines(values: dict[str, Any]) -> list[str]:
    return [f"{k} = {_toml_value(v)}\n" for k, v in values.items()]


def codex_snippet(t: AgentTarget) -> str:
    top, table = codex_values(t)
    return "".join(_toml_lines(top)) + f"\n[model_providers.{PROVIDER_ID}]\n" + "".join(_toml_lines(table))


_HEADER = re.compile(r"^\s*\[")
_OUR_HEADER = re.compile(r'^\s*\[\s*model_providers\s*\.\s*("moed"|moed)\s*\]\s*(#.*)?$')


def _set_keys(block: list[str], values: dict[str, Any]) -> list[str]:
    """The lines of one TOML block (top level or a table body) with values' keys replaced or appended."""
    block = list(block)
    for key, value in values.items():
        line = f"{key} = {_toml_value(value)}\n"
        at = next((i for i, ln in enumerate(block) if re.match(rf"^\s*{re.escape(key)}\s*=", ln)), None)
        if at is not None:
            block[at] = line
            continue
        end = len(block)
        while end and not block[end - 1].strip():
            end -= 1
        block.insert(end, line)
    return block


def merge_codex_config(text: str | None, t: AgentTarget, where: str) -> tuple[str, list[str]]:
    """config.toml with our top-level keys and [model_providers.moed] table; every other line kept as written.

    TOML is edited as text (our keys' lines replaced, or added at the end of the top-level block
    and of our table, which is appended when missing) and the result is checked with tomllib:
    every other value must come out the same, or nothing is written."""
    text = text or ""
    try:
        old = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequestError(f"{where} is not valid TOML ({exc}); fix it and run again. "
                                  "Nothing was written.") from None
    top, table = codex_values(t)
    changes = [_change(k, old.get(k), v, secret=t.token) for k, v in top.items() if old.get(k) != v]
    old_table = old.get("model_providers", {}).get(PROVIDER_ID, {})
    changes += [_change(f"model_providers.{PROVIDER_ID}.{k}", old_table.get(k), v, secret=t.token)
                for k, v in table.items() if old_table.get(k) != v]
    if not changes:
        return text, []
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    first_table = next((i for i, line in enumerate(lines) if _HEADER.match(line)), len(lines))
    head, rest = _set_keys(lines[:first_table], top), lines[first_table:]
    start = next((i for i, line in enumerate(rest) if _OUR_HEADER.match(line)), None)
    if start is None:
        if rest and rest[-1].strip():
            rest.append("\n")
        rest += [f"[model_providers.{PROVIDER_ID}]\n", *_toml_lines(table)]
    else:
        end = next((i for i in range(start + 1, len(rest)) if _HEADER.match(rest[i])), len(rest))
        rest[start + 1:end] = _set_keys(rest[start + 1:end], table)
    if head[-1].strip():
        head.append("\n")  # a blank line before the first table
    new_text = "".join(head + rest)
    _check_codex_merge(old, new_text, top, table, where, codex_snippet(t))
    return new_text, changes


def _check_codex_merge(old: dict, new_text: str, top: dict, table: dict, where: str, snippet: str) -> None:
    refuse = (f"{where} could not be updated automatically (its layout is unusual, e.g. model_providers "
              f"written inline); nothing was written. Add these lines by hand:\n{snippet}")
    try:
        new = tomllib.loads(new_text)
    except tomllib.TOMLDecodeError:
        raise InvalidRequestError(refuse) from None
    expected = {**old, **top}
    providers = dict(old.get("model_providers", {}))
    providers[PROVIDER_ID] = {**providers.get(PROVIDER_ID, {}), **table}
    expected["model_providers"] = providers
    if new != expected:
        raise InvalidRequestError(refuse)
