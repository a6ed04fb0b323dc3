"""`moed launch claude|opencode|codex`: print, or with --write merge, the settings that point an agent at moed.

The HTTP address, model name and context length come from the running daemon (GetStatus and
ListModels over gRPC) when it answers, else from --url / --model / --context. --write merges into the agent's own config file,
keeping every unrelated setting, saves a timestamped backup of a file it changes, and prints
each value it changed; a file that cannot be merged safely is left alone with a clear message.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moed.errors import InvalidRequestError, MoedError

AGENTS = ("claude", "opencode", "codex")
DEFAULT_URL = "http://127.0.0.1:8080"


def add_launch_command(sub, add_address) -> None:
    launch = sub.add_parser(
        "launch", help="point a coding agent (Claude Code, OpenCode, Codex CLI) at moed's HTTP API",
        description="Print the settings that point a coding agent at the moed HTTP server (start it with "
                    "`moed serve --http 127.0.0.1:8080`); with --write, merge them into the agent's config "
                    "file (~/.claude/settings.json, ~/.config/opencode/opencode.json, ~/.codex/config.toml), "
                    "keeping other settings and a backup of the old file.")
    add_address(launch)
    launch.add_argument("agent", choices=AGENTS)
    launch.add_argument("--write", action="store_true", help="write the settings into the agent's config file")
    launch.add_argument("--url", help=f"moed's HTTP server (default: the address the daemon's --http listens on; "
                                      f"{DEFAULT_URL} when no daemon answers)")
    launch.add_argument("--model", help="model name (default: the one model loaded in the daemon)")
    launch.add_argument("--context", type=int, help="context length in tokens (default: the daemon's figure)")
    launch.add_argument("--max-output", type=int, help="max output tokens for OpenCode (default: a quarter of "
                                                       "the context, at most 32768)")
    launch.add_argument("--config", metavar="FILE", help="write this file instead of the agent's default one")


@dataclass(frozen=True)
class DaemonFacts:
    """What the running daemon says: the model to use, its context, where its HTTP API listens ("": off)."""

    model: str
    context: int | None
    http_url: str


def _facts_from_daemon(address: str, token: str | None, want: str | None) -> DaemonFacts | None:
    """The daemon's model (``want`` or its one loaded model), context and HTTP URL; None when no daemon answers."""
    from moed.api.client import DaemonUnavailableError, MoedClient

    try:
        with MoedClient(address, token=token, timeout=3.0) as client:
            models = client.list_models()
            http_url = client.status().http_url
    except DaemonUnavailableError:
        return None
    if want:
        for m in models:
            if m.name == want:
                return DaemonFacts(m.name, m.context_length or None, http_url)
        return DaemonFacts(want, None, http_url)  # not known to the daemon (yet): trust the flag
    loaded = [m for m in models if m.loaded]
    if len(loaded) == 1:
        return DaemonFacts(loaded[0].name, loaded[0].context_length or None, http_url)
    if loaded:
        names = ", ".join(m.name for m in loaded)
        raise InvalidRequestError(f"several models are loaded ({names}); pick one with --model NAME.")
    raise InvalidRequestError(f"the daemon at {address} has no model loaded; load one (`moed load NAME`) "
                              "or pass --model NAME.")


def resolve_target(args: argparse.Namespace, address: str, token: str | None,
                   lookup: Callable[..., DaemonFacts | None] = _facts_from_daemon):
    """The AgentTarget for the flags: what the daemon says when it answers, else --url/--model/--context."""
    from moed.cli.agent_settings import AgentTarget

    if args.context is not None and args.context <= 0 or args.max_output is not None and args.max_output <= 0:
        raise InvalidRequestError("--context and --max-output must be positive numbers of tokens.")
    found = None if args.url and args.model and args.context else lookup(address, token, args.model)
    if found is None and not args.model:
        raise InvalidRequestError(
            f"no moed daemon answers at {address}, so the model is unknown. Start it "
            f"(`moed serve --http 127.0.0.1:8080`) and load a model, or pass --model NAME (and --context N).")
    if args.url:
        url = args.url
    elif found is not None and not found.http_url:
        raise InvalidRequestError(
            f"the daemon at {address} serves no HTTP API, which the agents need. Restart it with "
            f"`moed serve --http 127.0.0.1:8080`, or pass --url if another moed serves it.")
    else:
        url = found.http_url if found is not None else DEFAULT_URL
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise InvalidRequestError(f"--url must start with http:// or https://, got {url!r}.")
    name, context = (found.model, found.context) if found is not None else (args.model, None)
    return AgentTarget(url=url, model=name, context=args.context or context, max_output=args.max_output,
                       token=token)


def default_config_path(agent: str) -> Path:
    from moed import config

    if agent == "claude":
        return Path.home() / ".claude" / "settings.json"
    if agent == "opencode":
        return config.xdg_config_home() / "opencode" / "opencode.json"
    return config.codex_home() / "config.toml"


def _printed(agent: str, target, path: Path) -> str:
    import json

    from moed.cli import agent_settings as s

    if agent == "claude":
        return (f"# Claude Code: run these in your shell, then `claude`\n{s.claude_exports(target)}\n"
                f"# or `moed launch claude --write` to put them into {path} (\"env\")\n")
    if agent == "opencode":
        body = json.dumps(s.opencode_config(target), indent=2, ensure_ascii=False)
        return (f"// OpenCode: merge into {path} (or a project's opencode.json), then `opencode`\n{body}\n"
                f"// or `moed launch opencode --write`\n")
    key_line = f"# and export {s.CODEX_KEY_ENV}=<the daemon token> before starting codex\n" if target.token else ""
    return (f"# Codex CLI: merge into {path}, then `codex`\n{s.codex_snippet(target)}{key_line}"
            f"# or `moed launch codex --write`\n")


def _merge(agent: str, text: str | None, target, where: str) -> tuple[str, list[str]]:
    from moed.cli import agent_settings as s

    merge = {"claude": s.merge_claude_settings, "opencode": s.merge_opencode_config,
             "codex": s.merge_codex_config}[agent]
    return merge(text, target, where)


def _backup(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = path.with_name(f"{path.name}.bak-{stamp}")
    n = 1
    while backup.exists():
        backup = path.with_name(f"{path.name}.bak-{stamp}-{n}")
        n += 1
    shutil.copy2(path, backup)
    return backup


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o600  # a new file may hold the token
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_settings(agent: str, target, path: Path, out=None) -> bool:
    """Merge the agent's settings into path; True when the file changed."""
    out = out or sys.stdout
    try:
        old = path.read_text(encoding="utf-8") if path.exists() else None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {path} ({exc}); nothing was written.") from None
    text, changes = _merge(agent, old, target, str(path))
    if not changes:
        print(f"{path} already points {agent} at {target.url} with model {target.model}; nothing to change.",
              file=out)
        return False
    backup = _backup(path) if old is not None else None
    _write_atomic(path, text)
    print(f"{'updated' if old is not None else 'created'} {path}:", file=out)
    for line in changes:
        print(f"  {line}", file=out)
    if backup is not None:
        print(f"backup of the old file: {backup}", file=out)
    return True


def _next_steps(agent: str, target) -> str:
    from moed.cli.agent_settings import CODEX_KEY_ENV

    start = f"start the server if it is not running: moed serve --http {target.url.split('://', 1)[1]}"
    run = {"claude": "then run `claude`", "opencode": f"then run `opencode` (model moed/{target.model})",
           "codex": "then run `codex`"}[agent]
    extra = f"; export {CODEX_KEY_ENV}=<the daemon token> first" if agent == "codex" and target.token else ""
    return f"{start}; {run}{extra}"


def run_launch(args: argparse.Namespace, address: str, out=None) -> int:
    from moed import config

    out = out or sys.stdout

    target = resolve_target(args, address, config.daemon_token())
    if target.context is None and args.agent in ("opencode", "codex"):
        print("moed: note: the context length is unknown (no daemon figure, no --context): the agent will not "
              "know when to compact; pass --context N.", file=sys.stderr)
    path = Path(args.config).expanduser() if args.config else default_config_path(args.agent)
    if not args.write:
        print(_printed(args.agent, target, path), end="", file=out)
        return 0
    try:
        write_settings(args.agent, target, path, out=out)
    except OSError as exc:
        raise MoedError(f"cannot write {path} ({exc}); nothing else was changed.") from None
    print(_next_steps(args.agent, target), file=out)
    return 0
