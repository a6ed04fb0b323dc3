"""`moed serve --token-file PATH` and $MOED_TOKEN_FILE: the token never has to be on a command line,
where every local user can read it (/proc/PID/cmdline, ps)."""

from __future__ import annotations

import os
import socket as socketlib
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from helpers.daemon_process import start_daemon
from moed import config
from moed.api.client import DaemonCallError, MoedClient
from moed.cli.main import main
from moed.errors import InvalidRequestError

TOKEN = "s3cret-token-4f9a"
posix_only = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")


def token_file(path: Path, text: str = f"  {TOKEN}\n", mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def free_port() -> int:
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`moed serve` that is expected to refuse to start."""
    return subprocess.run([sys.executable, "-m", "moed.cli.main", "serve", "--socket", str(tmp_path / "a.sock"),
                           *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, MOED_RUNTIME_DIR=str(tmp_path / "run"), MOED_LOG_DIR=str(tmp_path),
                                   **(env or {})))


def test_read_token_file_strips_whitespace(tmp_path):
    assert config.read_token_file(token_file(tmp_path / "t")) == TOKEN
    assert config.read_token_file(token_file(tmp_path / "crlf", f"{TOKEN}\r\n")) == TOKEN


@posix_only
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_token_file_open_to_others_is_refused(tmp_path, mode):
    path = token_file(tmp_path / "t", mode=mode)
    with pytest.raises(InvalidRequestError, match=f"chmod 600 {path}") as info:
        config.read_token_file(path)
    assert f"{mode:04o}" in str(info.value)


@pytest.mark.parametrize("text, error", [("", "empty"), (" \n\t\n", "empty"), ("one\ntwo\n", "one line"),
                                         ("t\u00f6ken", "printable ASCII"), ("x" * 5000, "larger")])
def test_bad_token_file_contents(tmp_path, text, error):
    with pytest.raises(InvalidRequestError, match=error):
        config.read_token_file(token_file(tmp_path / "t", text))


def test_missing_or_odd_token_file(tmp_path):
    with pytest.raises(InvalidRequestError, match="cannot read"):
        config.read_token_file(tmp_path / "absent")
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        config.read_token_file(tmp_path)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo", 0o600)
        with pytest.raises(InvalidRequestError, match="not a regular file"):  # and does not block
            config.read_token_file(tmp_path / "fifo")


def test_daemon_token_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("MOED_TOKEN", raising=False)
    monkeypatch.delenv("MOED_TOKEN_FILE", raising=False)
    assert config.daemon_token() is None
    monkeypatch.setenv("MOED_TOKEN_FILE", str(token_file(tmp_path / "env-file", "from-env-file")))
    assert config.daemon_token() == "from-env-file"
    monkeypatch.setenv("MOED_TOKEN", "from-env")
    assert config.daemon_token() == "from-env"
    assert config.daemon_token(None, token_file(tmp_path / "arg-file", "from-arg-file")) == "from-arg-file"
    assert config.daemon_token("from-arg", None) == "from-arg"


@posix_only
def test_serve_refuses_a_readable_token_file_in_one_line(tmp_path):
    path = token_file(tmp_path / "token", mode=0o644)
    proc = serve(tmp_path, "--tcp", "0.0.0.0:0", "--token-file", str(path))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "chmod 600" in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("moed: error:")] == [
        proc.stderr.strip().splitlines()[-1]]
    proc = serve(tmp_path, "--token-file", str(token_file(tmp_path / "empty", "")))
    assert proc.returncode == 2 and "empty" in proc.stderr and "Traceback" not in proc.stderr
    proc = serve(tmp_path, env={"MOED_TOKEN_FILE": str(path)})  # the environment's file: same check
    assert proc.returncode == 2 and "chmod 600" in proc.stderr and "MOED_TOKEN_FILE" in proc.stderr


def test_token_and_token_file_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--token", "x", "--token-file", str(tmp_path / "t")])
    assert info.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_serve_with_token_file_enforces_it_and_keeps_it_off_the_command_line(tmp_path, monkeypatch, capsys):
    path = token_file(tmp_path / "token")
    port = free_port()
    d = start_daemon(tmp_path / "home", "--tcp", f"127.0.0.1:{port}", "--token-file", str(path))
    try:
        with pytest.raises(DaemonCallError) as info:
            MoedClient(f"127.0.0.1:{port}").status()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(DaemonCallError):
            MoedClient(f"127.0.0.1:{port}", token="wrong").status()
        assert MoedClient(f"127.0.0.1:{port}", token=TOKEN).status().state == "idle"
        assert MoedClient(str(d.socket), token=TOKEN).status().state == "idle"
        cmdline = Path(f"/proc/{d.proc.pid}/cmdline")
        if cmdline.exists():
            assert TOKEN not in cmdline.read_bytes().decode(errors="replace")

        # the moed command finds the token through $MOED_TOKEN_FILE
        monkeypatch.delenv("MOED_TOKEN", raising=False)
        monkeypatch.delenv("MOED_TOKEN_FILE", raising=False)
        assert main(["status", "--socket", f"127.0.0.1:{port}"]) == 2
        assert "requires a token" in capsys.readouterr().err
        monkeypatch.setenv("MOED_TOKEN_FILE", str(path))
        assert main(["status", "--socket", f"127.0.0.1:{port}"]) == 0
        assert "state idle" in capsys.readouterr().out
    finally:
        assert d.stop() == 0, (d.home / "daemon.out").read_text()


def test_serve_reads_the_token_file_named_by_the_environment(tmp_path, monkeypatch):
    """What the login services do: MOED_TOKEN_FILE in the daemon's environment, nothing on its command line."""
    monkeypatch.delenv("MOED_TOKEN", raising=False)
    monkeypatch.setenv("MOED_TOKEN_FILE", str(token_file(tmp_path / "token")))
    port = free_port()
    d = start_daemon(tmp_path / "home", "--tcp", f"0.0.0.0:{port}")  # non-loopback: only starts with a token
    try:
        with pytest.raises(DaemonCallError) as info:
            MoedClient(f"127.0.0.1:{port}").status()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert MoedClient(f"127.0.0.1:{port}", token=TOKEN).status().state == "idle"
    finally:
        assert d.stop() == 0, (d.home / "daemon.out").read_text()
