"""Runtime dir, socket, lock, logs and model dirs per platform, from PathEnv."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from moed.config import PathEnv, path_env
from moed.errors import MoedError
from moed.service import paths

posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX uids")


def test_runtime_dir_under_xdg_runtime_dir_is_private(tmp_path):
    env = PathEnv(xdg_runtime_dir=str(tmp_path))
    path = paths.runtime_dir(env, "linux")
    assert path == tmp_path / "moed" and path.is_dir()
    if hasattr(os, "getuid"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert paths.socket_path(env, "linux") == tmp_path / "moed" / "moed.sock"
    assert paths.lock_file_path(env, "linux") == tmp_path / "moed" / "moed.lock"
    assert paths.default_address(env, "linux") == f"unix://{tmp_path}/moed/moed.sock"


@posix_only
def test_runtime_dir_falls_back_to_tmp_per_uid():
    path = paths.runtime_dir(PathEnv(), "linux", create=False)
    assert path == Path(f"/tmp/moed-{os.getuid()}")


@posix_only
def test_runtime_dir_tightens_loose_permissions(tmp_path):
    loose = tmp_path / "rt"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    paths.runtime_dir(PathEnv(runtime_dir=str(loose)), "linux")
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


@posix_only
def test_runtime_dir_that_is_a_file_is_refused_with_advice(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(MoedError, match="MOED_RUNTIME_DIR"):
        paths.runtime_dir(PathEnv(runtime_dir=str(not_a_dir)), "linux")


def test_too_long_socket_path_is_refused(tmp_path):
    deep = tmp_path / ("d" * 120)
    with pytest.raises(MoedError, match="shorter directory"):
        paths.default_address(PathEnv(runtime_dir=str(deep)), "linux")


def test_windows_uses_localappdata_and_tcp(tmp_path):
    env = PathEnv(local_appdata=str(tmp_path))
    assert paths.log_dir(env, "win32") == tmp_path / "moed" / "logs"
    assert paths.runtime_dir(env, "win32") == tmp_path / "moed" / "run"
    assert paths.default_address(env, "win32") == paths.DEFAULT_TCP_ADDRESS
    assert paths.model_dirs(env, "win32")[0] == tmp_path / "moed" / "models"
    assert paths.model_dirs(PathEnv(models="C:\\m1;D:\\m2"), "win32") == [Path("C:\\m1"), Path("D:\\m2")]


def test_log_dir_per_platform():
    home = Path.home()
    assert paths.log_dir(PathEnv(), "linux") == home / ".local" / "state" / "moed" / "logs"
    assert paths.log_dir(PathEnv(xdg_state_home="/s"), "linux") == Path("/s/moed/logs")
    assert paths.log_dir(PathEnv(), "darwin") == home / "Library" / "Logs" / "moed"
    assert paths.log_dir(PathEnv(log_dir="/l", xdg_state_home="/s"), "linux") == Path("/l")


def test_model_dirs_from_moed_models_or_defaults(monkeypatch, tmp_path):
    assert paths.model_dirs(PathEnv(models="/a:/b::/c"), "linux") == [Path("/a"), Path("/b"), Path("/c")]
    monkeypatch.chdir(tmp_path)
    assert paths.model_dirs(PathEnv(), "linux") == [Path.home() / ".local/share/moed/models", tmp_path / "models"]
    assert paths.model_dirs(PathEnv(xdg_data_home="/d"), "linux")[0] == Path("/d/moed/models")


def test_path_env_reads_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MOED_MODELS", "/x:/y")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", "")  # empty counts as unset
    monkeypatch.delenv("MOED_RUNTIME_DIR", raising=False)
    env = path_env()
    assert env.models == "/x:/y" and env.xdg_runtime_dir == str(tmp_path) and env.xdg_state_home is None
    assert paths.model_dirs() == [Path("/x"), Path("/y")]
    if os.name == "posix":
        assert paths.runtime_dir() == tmp_path / "moed"
