"""What the scripted model says to a coding agent, and the daemon hook that puts it in front of a loaded model.

`moed serve` started with MOED_TEST_RUNTIME_HOOK=helpers.agent_script:install (and PYTHONPATH holding
tests/) serves every model it loads through ``install``: the model's own config, tokenizer and chat
template stay, its logits come from ``answer`` (moed.engine.runtime_hook). ``answer`` calls the
agent's file-reading tool on hello.txt in $MOED_TEST_AGENT_WORKDIR first, and repeats the file's text
once a prompt shows it (so the tool really ran). Each prompt the model answered is appended, as one
JSON string per line, to $MOED_TEST_AGENT_PROMPTS when set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

SECRET = "the-file-says-7419"
FINAL = f"DONE: hello.txt holds {SECRET}"


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def answer(prompt: str, workdir: Path) -> str:
    """A read call first, the file's text once a result shows it; a title for side requests without tools."""
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


def install(runtime):
    """The daemon's hook: ``runtime`` with a scripted logits source in front of its model."""
    from helpers.http_daemon import ChatScriptedModel

    workdir = Path(os.environ["MOED_TEST_AGENT_WORKDIR"])
    prompts = os.environ.get("MOED_TEST_AGENT_PROMPTS")

    def respond(prompt: str) -> str:
        if prompts:
            with open(prompts, "a", encoding="utf-8") as f:
                f.write(json.dumps(prompt) + "\n")
        return answer(prompt, workdir)

    real = runtime.model
    scripted = ChatScriptedModel(runtime.tokenizer, respond, family=real.config.family,
                                 eos=real.config.eos_token_ids[0])
    scripted.config = real.config  # the demo model's own: vocab, positions, end tokens, family
    scripted.device = None
    runtime.model = scripted
    return runtime
