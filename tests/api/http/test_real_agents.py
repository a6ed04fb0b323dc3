"""The real coding agents (Claude Code, Codex, opencode from npm) against moed's HTTP server, two turns with a tool.

`make agents` installs the pinned versions under .cache/agents (`make test` does it first where npm
exists). Each agent runs non-interactively (`claude -p`, `codex exec`, `opencode run`) with only the
settings `moed launch AGENT --write` wrote into its config (HOME is a temporary directory), in a
directory holding hello.txt. The model behind the server is a scripted one: its answers are forced
token by token (a tiny model cannot call a tool reliably), so what is real here is everything else:
the agent, its requests as it sends them, the HTTP layer, the chat template (a ChatML template with
no tool syntax, like the demo model's: the generic tool format), the tokenizer, the output parser and
the stream framing. Turn one: the model answers the agent's prompt with a call of the agent's
file-reading tool; the agent runs it; turn two: the model sees the file's text in the tool result and
answers with it, and the agent prints that answer.

Each agent's first request is also kept as test data (tests/api/http/agent_captures) and replayed in
test_agent_captures.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.http_daemon import ChatScriptedModel, add_scripted_model, start_http_daemon, tools_tokenizer
from helpers.tiny_tokenizer import CHATML_TEMPLATE

ROOT = Path(__file__).resolve().parents[3]
AGENTS_BIN = ROOT / ".cache" / "agents" / "node_modules" / ".bin"
MODEL = "demo-agent"
CONTEXT = 196608  # the tiny tokenizer spends about one token per 2 characters: Claude Code's prompt is ~90k
SECRET = "the-file-says-7419"
FINAL = f"DONE: hello.txt holds {SECRET}"


def _require_agents() -> None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the real agents cannot run here")
    missing = [a for a in ("claude", "codex", "opencode") if not (AGENTS_BIN / a).exists()]
    if missing:
        message = f"the agents {missing} are not installed under {AGENTS_BIN.parent}: run `make agents`"
        if os.environ.get("MOED_REQUIRE_AGENTS") == "1":  # set by `make test`, which installs them first
            pytest.fail(message)
        pytest.skip(message)


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def answer(prompt: str, workdir: Path) -> str:
    """What the scripted model says to a prompt: a read call first, the file's text once a result shows it."""
    if SECRET in prompt:
        return FINAL
    if "# Tools" not in prompt:  # side requests without tools (Claude Code's session title)
        return '{"title": "Read hello.txt"}'
    path = str(workdir / "hello.txt")
    if '"name": "Read"' in prompt:  # Claude Code
        return _call("Read", {"file_path": path})
    if '"name": "exec_command"' in prompt:  # Codex
        return _call("exec_command", {"cmd": "cat hello.txt"})
    if '"name": "read"' in prompt:  # opencode
        return _call("read", {"filePath": path})
    return "I have no tool to read files with."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _require_agents()
    workdir = tmp_path_factory.mktemp("project")
    (workdir / "hello.txt").write_text(SECRET + "\n")
    d = start_http_daemon()
    model = ChatScriptedModel(tools_tokenizer(tmp_path_factory.mktemp("tok"), CHATML_TEMPLATE),
                              lambda prompt: answer(prompt, workdir), family="mixtral")
    model.config = dataclasses.replace(model.config, max_position_embeddings=CONTEXT)
    add_scripted_model(d, MODEL, model, context_length=CONTEXT)
    yield d, model, workdir
    d.close()


def _launch(agent: str, url: str, home: Path) -> None:
    moed = [sys.executable, "-c", "import sys; from moed.cli.main import main; sys.exit(main(sys.argv[1:]))"]
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "CODEX_HOME": str(home / ".codex")}
    done = subprocess.run([*moed, "launch", agent, "--write", "--url", url, "--model", MODEL, "--context", str(CONTEXT)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _agent_env(home: Path) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    return {**keep, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "CODEX_HOME": str(home / ".codex"),
            "NO_COLOR": "1", "CI": "1"}


COMMANDS = {
    "claude": ["-p", "What does hello.txt say?"],
    "codex": ["exec", "--skip-git-repo-check", "What does hello.txt say?"],
    "opencode": ["run", "What does hello.txt say?"],
}


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_the_real_agent_completes_a_two_turn_session_with_a_tool_call(served, agent, tmp_path):
    daemon, model, workdir = served
    home = tmp_path / "home"
    home.mkdir()
    _launch(agent, daemon.url, home)
    seen = len(model.prompts)
    done = subprocess.run([str(AGENTS_BIN / agent), *COMMANDS[agent]], cwd=workdir, env=_agent_env(home),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    prompts = model.prompts[seen:]
    assert done.returncode == 0, output[-3000:]
    assert FINAL in done.stdout, output[-3000:]
    # the tool really ran: a later prompt carries the file's text inside a tool result
    assert any(re.search(r"<tool_response>[\s\S]*" + SECRET, p) for p in prompts), prompts[-1][-2000:]
