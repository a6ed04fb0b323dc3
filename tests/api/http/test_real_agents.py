"""The real coding agents (Claude Code, Codex, opencode from npm) against `moed serve` on the demo model.

As a user sets it up: the demo model (helpers.demo_model: SmolLM2-135M upcycled, converted by `moed
convert` with q8 experts into a models directory as demo-moe-ftw), `moed serve --http 127.0.0.1:0`,
`moed load demo-moe-ftw`, `moed launch AGENT --write` (address, model and context read from the daemon;
HOME is a temporary directory), and the pinned agent run non-interactively (`claude -p`, `codex exec`,
`opencode run`) with nothing but those settings, in a directory holding hello.txt. `make agents`
installs the agents under .cache/agents (`make test` does it first where npm exists).

One thing is not the product: the daemon runs with MOED_TEST_RUNTIME_HOOK=helpers.agent_script:install,
which puts a scripted logits source in front of the loaded model, because a 135M model does not call a
tool on cue. The demo model's config, context, tokenizer and chat template (ChatML without tool syntax:
the generic tool format), the output parser, the engine loop, the HTTP layer, the access log and the
agent are all real. Turn one: the model answers the agent's prompt with a call of the agent's
file-reading tool; the agent runs it; turn two: the model sees the file's text in the tool result and
answers with it, and the agent prints that answer.

Each agent's requests are kept as test data (tests/api/http/agent_captures) and replayed in
test_agent_captures.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.agent_script import FINAL, SECRET
from helpers.daemon_process import start_daemon

pytestmark = pytest.mark.slow  # builds the demo model

ROOT = Path(__file__).resolve().parents[3]
TESTS = ROOT / "tests"
AGENTS_BIN = ROOT / ".cache" / "agents" / "node_modules" / ".bin"
MODEL = "demo-moe-ftw"
ACCESS = re.compile(r'"POST (?P<path>/v1/\S+)" (?P<status>\d+) model=\S+ prompt=(?P<prompt>\d+) '
                    r'cached=(?P<cached>\d+) generated=(?P<generated>\d+)')


def _require_agents() -> None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the real agents cannot run here")
    missing = [a for a in ("claude", "codex", "opencode") if not (AGENTS_BIN / a).exists()]
    if missing:
        message = f"the agents {missing} are not installed under {AGENTS_BIN.parent}: run `make agents`"
        if os.environ.get("MOED_REQUIRE_AGENTS") == "1":  # set by `make test`, which installs them first
            pytest.fail(message)
        pytest.skip(message)


def moed(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "moed.cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"moed {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


class Served:
    def __init__(self, daemon, workdir: Path, prompts: Path) -> None:
        self.daemon, self.workdir, self.prompts_file = daemon, workdir, prompts

    def client_env(self, home: Path | None = None) -> dict:
        env = {**os.environ, "MOED_SOCKET": str(self.daemon.socket)}
        if home is not None:
            env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), CODEX_HOME=str(home / ".codex"))
        return env

    def prompts(self) -> list[str]:
        if not self.prompts_file.exists():
            return []
        return [json.loads(line) for line in self.prompts_file.read_text().splitlines()]

    def access_lines(self) -> list[str]:
        return [line for f in sorted((self.daemon.home / "logs").glob("moed.log*"))
                for line in f.read_text(errors="replace").splitlines() if '"POST /v1/' in line]


@pytest.fixture(scope="module")
def served(demo_model, tmp_path_factory):
    _require_agents()
    root = tmp_path_factory.mktemp("agents")
    models = root / "models"
    moed("convert", str(demo_model.hf_dir), str(models / MODEL), "--experts-dtype", "q8", env=dict(os.environ))
    workdir = root / "project"
    workdir.mkdir()
    (workdir / "hello.txt").write_text(SECRET + "\n")
    prompts = root / "prompts.jsonl"
    hook = {"MOED_TEST_RUNTIME_HOOK": "helpers.agent_script:install", "MOED_TEST_AGENT_WORKDIR": str(workdir),
            "MOED_TEST_AGENT_PROMPTS": str(prompts),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    daemon = start_daemon(root / "daemon", "--http", "127.0.0.1:0", models_dir=models, extra_env=hook)
    try:
        s = Served(daemon, workdir, prompts)
        moed("load", MODEL, "--device", "cpu", env=s.client_env())
        yield s
    finally:
        daemon.stop()


def _agent_env(home: Path) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    return {**keep, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "CODEX_HOME": str(home / ".codex"),
            "NO_COLOR": "1", "CI": "1"}


COMMANDS = {
    "claude": ["-p", "What does hello.txt say?"],
    "codex": ["exec", "--skip-git-repo-check", "What does hello.txt say?"],
    "opencode": ["run", "What does hello.txt say?"],
}


def test_moed_status_and_ps_show_the_http_address_and_the_context(served):
    status = moed("status", env=served.client_env()).stdout
    url = re.search(r"HTTP API (http://127\.0\.0\.1:\d+)", status)
    assert url and not url.group(1).endswith(":0"), status
    assert "context 32768" in status  # the demo model's positions; its KV pool fits any test machine
    assert re.search(rf"{MODEL}\s.*32768", moed("ps", env=served.client_env()).stdout)


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_the_real_agent_completes_a_two_turn_session_with_a_tool_call(served, agent, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    moed("launch", agent, "--write", env=served.client_env(home))  # nothing but what launch wrote
    seen, logged = len(served.prompts()), len(served.access_lines())
    done = subprocess.run([str(AGENTS_BIN / agent), *COMMANDS[agent]], cwd=served.workdir, env=_agent_env(home),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    prompts = served.prompts()[seen:]
    assert done.returncode == 0, output[-3000:]
    assert FINAL in done.stdout, output[-3000:]
    # the tool really ran: a later prompt carries the file's text inside a tool result
    assert any(re.search(r"<tool_response>[\s\S]*" + SECRET, p) for p in prompts), prompts[-1][-2000:]
    # every request the agent sent is in the access log, answered 200 with its token figures
    lines = served.access_lines()[logged:]
    requests = [m for m in map(ACCESS.search, lines) if m]
    assert requests and len(requests) == len(lines), lines
    assert all(m["status"] == "200" for m in requests), lines
    if agent == "claude":
        # its two tool-carrying requests share the first one's prompt: the second prefills only its new tokens
        main = [m for m in requests if int(m["prompt"]) > 5000]
        assert len(main) >= 2, lines
        first, second = main[0], main[1]
        assert int(second["cached"]) >= 0.99 * int(first["prompt"]), lines
