"""`moed launch claude|opencode|codex`: printed settings, and --write merging into existing files (temp HOME)."""

from __future__ import annotations

import json
import stat
import tomllib
from pathlib import Path

import pytest

from moed.cli.main import main
from moed.v1 import control_pb2

URL = "http://127.0.0.1:18080"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CONFIG_HOME", "CODEX_HOME", "MOED_TOKEN", "MOED_TOKEN_FILE", "MOED_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MOED_SOCKET", str(tmp_path / "no-daemon.sock"))  # nothing answers there
    return home


def launch(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["launch", *args, "--url", URL])
    out, err = capsys.readouterr()
    return code, out, err


def backups(path: Path) -> list[Path]:
    return sorted(path.parent.glob(path.name + ".bak-*"))


def test_claude_prints_exports_and_writes_nothing(home, capsys):
    code, out, _ = launch(capsys, "claude", "--model", "qwen3-30b")
    assert code == 0
    assert f"export ANTHROPIC_BASE_URL={URL}\n" in out
    for var in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "ANTHROPIC_SMALL_FAST_MODEL"):
        assert f"export {var}=qwen3-30b\n" in out
    assert "export ANTHROPIC_AUTH_TOKEN=moed\n" in out  # a placeholder: the daemon has no token
    assert "CLAUDE_CODE_MAX_OUTPUT_TOKENS" not in out  # no context known: Claude Code's own default
    assert "export CLAUDE_CODE_ATTRIBUTION_HEADER=0\n" in out  # else no two requests share a prefix
    assert not (home / ".claude").exists()
    # with the context known, Claude Code's output budget stays inside it and it compacts before it is full
    code, out, _ = launch(capsys, "claude", "--model", "qwen3-30b", "--context", "8192")
    assert code == 0 and "export CLAUDE_CODE_MAX_OUTPUT_TOKENS=2048\n" in out
    assert "export CLAUDE_CODE_AUTO_COMPACT_WINDOW=8192\n" in out


def test_claude_write_merges_into_settings_and_keeps_a_backup(home, capsys):
    path = home / ".claude" / "settings.json"
    path.parent.mkdir()
    old = {"theme": "dark", "permissions": {"allow": ["Bash(ls)"]}, "env": {"FOO": "1", "ANTHROPIC_MODEL": "opus"}}
    path.write_text(json.dumps(old))
    code, out, _ = launch(capsys, "claude", "--model", "qwen3-30b", "--write")
    assert code == 0
    data = json.loads(path.read_text())
    assert data["theme"] == "dark" and data["permissions"] == old["permissions"] and data["env"]["FOO"] == "1"
    assert data["env"]["ANTHROPIC_BASE_URL"] == URL and data["env"]["ANTHROPIC_MODEL"] == "qwen3-30b"
    assert 'env.ANTHROPIC_MODEL = "qwen3-30b" (was "opus")' in out
    (backup,) = backups(path)
    assert json.loads(backup.read_text()) == old
    # a second run changes nothing and makes no second backup
    code, out, _ = launch(capsys, "claude", "--model", "qwen3-30b", "--write")
    assert code == 0 and "nothing to change" in out and len(backups(path)) == 1


def test_token_goes_into_the_settings_but_not_into_the_change_list(home, capsys, monkeypatch):
    monkeypatch.setenv("MOED_TOKEN", "s3cret-token")
    code, out, _ = launch(capsys, "claude", "--model", "m", "--write")
    assert code == 0 and "s3cret-token" not in out and '"****"' in out
    path = home / ".claude" / "settings.json"
    assert json.loads(path.read_text())["env"]["ANTHROPIC_AUTH_TOKEN"] == "s3cret-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # a new file holding a token is private
    code, out, _ = launch(capsys, "codex", "--model", "m", "--context", "4096", "--write")
    cfg = tomllib.loads((home / ".codex" / "config.toml").read_text())
    assert cfg["model_providers"]["moed"]["env_key"] == "MOED_API_KEY" and "MOED_API_KEY" in out
    code, out, _ = launch(capsys, "opencode", "--model", "m", "--write")
    cfg = json.loads((home / ".config" / "opencode" / "opencode.json").read_text())
    assert cfg["provider"]["moed"]["options"]["apiKey"] == "s3cret-token"


def test_opencode_write_merges_provider_and_model_limits(home, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "xdg"))
    path = home / "xdg" / "opencode" / "opencode.json"
    path.parent.mkdir(parents=True)
    old = {"$schema": "https://opencode.ai/config.json", "theme": "tokyonight", "model": "anthropic/claude",
           "provider": {"ollama": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": "http://x/v1"}},
                        "moed": {"models": {"older-model": {"name": "kept"}}, "options": {"timeout": 600000}}}}
    path.write_text(json.dumps(old, indent=4))
    code, out, _ = launch(capsys, "opencode", "--model", "qwen3-30b", "--context", "40960", "--write")
    assert code == 0
    data = json.loads(path.read_text())
    assert data["theme"] == "tokyonight" and data["provider"]["ollama"] == old["provider"]["ollama"]
    moed = data["provider"]["moed"]
    assert moed["npm"] == "@ai-sdk/openai-compatible" and moed["options"] == {"timeout": 600000,
                                                                             "baseURL": URL + "/v1"}
    assert moed["models"]["older-model"] == {"name": "kept"}
    assert moed["models"]["qwen3-30b"]["limit"] == {"context": 40960, "output": 10240}
    assert data["model"] == "moed/qwen3-30b" and 'model = "moed/qwen3-30b" (was "anthropic/claude")' in out
    assert json.loads(backups(path)[0].read_text()) == old


def test_codex_write_keeps_other_lines_and_tables(home, capsys):
    path = home / ".codex" / "config.toml"
    path.parent.mkdir()
    old_text = ('# my settings\nmodel = "gpt-5"  # the default\napproval_policy = "on-request"\n\n'
                '[model_providers.other]\nname = "Other"\nbase_url = "http://other/v1"\n\n'
                '[model_providers.moed]\nname = "old name"\nhttp_headers = { X-Team = "a" }\n\n'
                '[mcp_servers.docs]\ncommand = "docs-server"\nargs = ["--port", "1"]\n')
    path.write_text(old_text)
    code, out, _ = launch(capsys, "codex", "--model", "qwen3-30b", "--context", "40960", "--write")
    assert code == 0
    text = path.read_text()
    cfg = tomllib.loads(text)
    old = tomllib.loads(old_text)
    assert cfg["model"] == "qwen3-30b" and cfg["model_provider"] == "moed" and cfg["model_context_window"] == 40960
    assert cfg["model_providers"]["moed"] == {"name": "moed (local)", "base_url": URL + "/v1",
                                              "wire_api": "responses", "http_headers": {"X-Team": "a"},
                                              "stream_idle_timeout_ms": 3000000}
    assert cfg["model_providers"]["other"] == old["model_providers"]["other"]
    assert cfg["mcp_servers"] == old["mcp_servers"] and cfg["approval_policy"] == "on-request"
    assert text.startswith("# my settings\n")
    assert backups(path)[0].read_text() == old_text
    assert 'model = "qwen3-30b" (was "gpt-5")' in out


def test_agent_homes_and_config_flag_are_respected(home, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "codex-home"))
    assert launch(capsys, "codex", "--model", "m", "--context", "64", "--write")[0] == 0
    assert tomllib.loads((tmp_path / "codex-home" / "config.toml").read_text())["model"] == "m"
    target = tmp_path / "project" / "opencode.json"
    assert launch(capsys, "opencode", "--model", "m", "--config", str(target), "--write")[0] == 0
    assert json.loads(target.read_text())["model"] == "moed/m"
    assert not (home / ".config").exists() and not (home / ".codex").exists()


def test_codex_prints_the_table(home, capsys):
    code, out, _ = launch(capsys, "codex", "--model", "qwen3-30b", "--context", "8192")
    assert code == 0
    snippet = out.split("\n", 1)[1].rsplit("# or", 1)[0]
    cfg = tomllib.loads(snippet)
    assert cfg["model_providers"]["moed"]["wire_api"] == "responses" and cfg["model_context_window"] == 8192
    assert not (home / ".codex").exists()


@pytest.mark.parametrize("agent, rel, content", [
    ("claude", ".claude/settings.json", "{not json"),
    ("claude", ".claude/settings.json", '{"env": ["a"]}'),
    ("opencode", ".config/opencode/opencode.json", "// comments\n{}"),
    ("codex", ".codex/config.toml", "model = \n"),
    ("codex", ".codex/config.toml", 'model_providers = { moed = { name = "inline" } }\n'),
])
def test_files_that_cannot_be_merged_are_left_alone(home, capsys, agent, rel, content):
    path = home / rel
    path.parent.mkdir(parents=True)
    path.write_text(content)
    code, _, err = launch(capsys, agent, "--model", "m", "--context", "4096", "--write")
    assert code == 2 and "nothing was written" in err.lower()
    assert path.read_text() == content and not backups(path)


def test_without_daemon_or_model_says_what_to_do(home, capsys):
    code, out, err = launch(capsys, "claude")
    assert code == 2 and "no moed daemon answers" in err and "--model" in err and out == ""


class FakeClient:
    models: list = []
    http_url = "http://127.0.0.1:43210"

    def __init__(self, address, token=None, timeout=10.0):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def list_models(self):
        return self.models

    def status(self):
        return control_pb2.Status(http_url=self.http_url)


def info(name: str, loaded: bool, context: int = 0):
    return control_pb2.ModelInfo(name=name, loaded=loaded, context_length=context)


def test_model_and_context_come_from_the_daemon(home, capsys, monkeypatch):
    monkeypatch.setattr("moed.api.client.MoedClient", FakeClient)
    FakeClient.models = [info("on-disk", False), info("qwen3-30b", True, 32768)]
    code, out, _ = launch(capsys, "codex")
    assert code == 0 and 'model = "qwen3-30b"' in out and "model_context_window = 32768" in out
    code, out, _ = launch(capsys, "codex", "--model", "on-disk", "--context", "1024")  # both flags: no lookup
    assert code == 0 and 'model = "on-disk"' in out and "model_context_window = 1024" in out
    FakeClient.models = [info("a", True, 10), info("b", True, 10)]
    code, _, err = launch(capsys, "claude")
    assert code == 2 and "several models are loaded (a, b)" in err
    FakeClient.models = [info("a", False)]
    code, _, err = launch(capsys, "claude")
    assert code == 2 and "no model loaded" in err


def test_the_http_address_comes_from_the_daemon(home, capsys, monkeypatch):
    monkeypatch.setattr("moed.api.client.MoedClient", FakeClient)
    FakeClient.models = [info("qwen3-30b", True, 32768)]
    FakeClient.http_url = "http://127.0.0.1:43210"  # `moed serve --http 127.0.0.1:0` picked this port
    code = main(["launch", "opencode"])
    out, _ = capsys.readouterr()
    assert code == 0 and '"baseURL": "http://127.0.0.1:43210/v1"' in out
    assert launch(capsys, "opencode")[1].count(URL) == 1  # --url wins
    FakeClient.http_url = ""  # a daemon without --http: the agents could not reach it
    code = main(["launch", "claude"])
    _, err = capsys.readouterr()
    assert code == 2 and "serves no HTTP API" in err and "--http 127.0.0.1:8080" in err
    code = main(["launch", "claude", "--url", URL])
    assert code == 0 and f"ANTHROPIC_BASE_URL={URL}" in capsys.readouterr().out


def test_help_lists_launch(capsys):
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    assert "claude" in capsys.readouterr().out
