"""Login-service files: the templates render to valid files, and `moed service` round-trips in a temp home."""

from __future__ import annotations

import configparser
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moed.cli import service_cmd as svc
from moed.cli.main import main

WEIRD = "/opt/my apps/moed's \"env\"/bin"  # spaces and quotes: every syntax must survive them


def rendered(platform: str, home: Path, bin_dir: str = "/opt/moed/bin") -> dict[str, str]:
    values = {"MOED": f"{bin_dir}/moed", "MOED_TRAY": f"{bin_dir}/moed-tray",
              "LOG_DIR": str(svc.log_dir_for(platform, home))}
    return {f.target.name: svc.render(f, values) for f in svc.service_files(platform, home)}


def run_cli(*args: str, capsys) -> tuple[int, str]:
    code = main(["service", *args])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("bin_dir", ["/opt/moed/bin", WEIRD])
def test_launch_agents_are_valid_plists(tmp_path, bin_dir):
    files = rendered("darwin", tmp_path, bin_dir)
    daemon = plistlib.loads(files["ai.moed.daemon.plist"].encode())
    tray = plistlib.loads(files["ai.moed.tray.plist"].encode())
    assert daemon["Label"] == "ai.moed.daemon" and daemon["ProgramArguments"] == [f"{bin_dir}/moed", "serve"]
    assert daemon["RunAtLoad"] and daemon["KeepAlive"] == {"SuccessfulExit": False}
    assert daemon["StandardErrorPath"] == str(tmp_path / "Library" / "Logs" / "moed" / "daemon.out")
    assert tray["Label"] == "ai.moed.tray" and tray["ProgramArguments"] == [f"{bin_dir}/moed-tray"]


def test_desktop_entry_has_exec_and_type(tmp_path):
    text = rendered("linux", tmp_path)["moed-tray.desktop"]
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str
    entry.read_string(text)
    section = entry["Desktop Entry"]
    assert section["Type"] == "Application" and section["Exec"] == "/opt/moed/bin/moed-tray"
    assert section["Name"] and section["Terminal"] == "false"
    weird = rendered("linux", tmp_path, WEIRD)["moed-tray.desktop"]
    assert 'Exec="/opt/my apps/moed\'s \\"env\\"/bin/moed-tray"' in weird


def test_systemd_unit_runs_moed_serve(tmp_path):
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str
    unit.read_string(rendered("linux", tmp_path)["moed.service"])
    assert unit["Service"]["ExecStart"] == "/opt/moed/bin/moed serve"
    assert unit["Install"]["WantedBy"] == "default.target"
    weird = rendered("linux", tmp_path, "/opt/100% my apps")["moed.service"]
    assert 'ExecStart="/opt/100%% my apps/moed" serve' in weird


def test_windows_script_quotes_paths_and_has_uninstall(tmp_path):
    text = rendered("win32", tmp_path, "C:\\Users\\O'Neil\\moed\\Scripts")["install-moed.ps1"]
    assert "$Moed = 'C:\\Users\\O''Neil\\moed\\Scripts/moed'" in text
    assert "@MOED" not in text and "-AtLogOn" in text and "Unregister-ScheduledTask" in text
    assert text.count("Register-ScheduledTask -TaskName") == 2


def test_systemd_analyze_verifies_the_installed_unit(tmp_path, capsys):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    # first make sure the verifier rejects something broken here, else a pass means nothing
    bad = tmp_path / "bad" / "moed.service"
    bad.parent.mkdir()
    bad.write_text("[Service]\nExecStart=not-an-absolute-command serve\n")
    if subprocess.run([analyze, "verify", str(bad)], capture_output=True).returncode == 0:
        pytest.skip("systemd-analyze verify accepts a broken unit on this machine (no checks possible)")
    code, _ = run_cli("install", "--home", str(tmp_path / "home"), "--no-start", "--platform", "linux", capsys=capsys)
    assert code == 0
    unit = tmp_path / "home" / ".config" / "systemd" / "user" / "moed.service"
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"ExecStart={Path(sys.executable).parent / 'moed'} serve" in unit.read_text()


@pytest.mark.parametrize("platform", ["linux", "darwin", "win32"])
def test_install_status_uninstall_round_trip(tmp_path, capsys, platform):
    home = tmp_path / "home"
    expected = [f.target for f in svc.service_files(platform, home)]
    assert all(str(p).startswith(str(home)) for p in expected)

    code, out = run_cli("status", "--home", str(home), "--no-start", "--platform", platform, capsys=capsys)
    assert code == 0 and out.count("not installed") == len(expected)

    code, out = run_cli("install", "--home", str(home), "--no-start", "--platform", platform, capsys=capsys)
    assert code == 0 and all(p.is_file() for p in expected)
    assert "@MOED" not in "".join(p.read_text() for p in expected)
    if platform == "linux":
        assert "systemctl --user enable --now moed.service" in out  # not run: printed
    if platform == "darwin":
        assert f"launchctl load -w {expected[0]}" in out

    code, out = run_cli("status", "--home", str(home), "--no-start", "--platform", platform, capsys=capsys)
    assert code == 0 and "not installed" not in out and out.count("installed: ") == len(expected)

    expected[0].write_text(expected[0].read_text().replace(str(Path(sys.executable).parent), "/elsewhere"))
    code, out = run_cli("status", "--home", str(home), "--no-start", "--platform", platform, capsys=capsys)
    assert "for another moed installation" in out

    code, out = run_cli("uninstall", "--home", str(home), "--no-start", "--platform", platform, capsys=capsys)
    assert code == 0 and not any(p.exists() for p in expected)
    code, out = run_cli("uninstall", "--home", str(home), "--no-start", "--platform", platform, capsys=capsys)
    assert code == 0 and "nothing was installed" in out


def test_home_defaults_to_the_home_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    code, _ = run_cli("install", "--no-start", "--platform", "linux", capsys=capsys)
    assert code == 0 and (tmp_path / ".config" / "autostart" / "moed-tray.desktop").is_file()
    code, _ = run_cli("uninstall", "--no-start", "--platform", "linux", capsys=capsys)
    assert not (tmp_path / ".config" / "autostart" / "moed-tray.desktop").exists()


TOKEN = "s3cret-token-7c1e"


def _token_file(path: Path, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("platform", ["linux", "darwin", "win32"])
def test_token_file_goes_in_the_environment_never_the_token_itself(tmp_path, capsys, platform):
    """`moed service install --token-file F`: the daemon and tray get MOED_TOKEN_FILE=F in their environment;
    the token is in no installed file and on no command line (ExecStart, ProgramArguments, task arguments)."""
    home = tmp_path / "home"
    token = _token_file(tmp_path / "my keys" / "moed token")  # spaces: every syntax must quote it
    code, out = run_cli("install", "--home", str(home), "--no-start", "--platform", platform,
                        "--tcp", "0.0.0.0:50515", "--token-file", str(token), capsys=capsys)
    assert code == 0 and str(token) in out
    installed = {f.target.name: f.target.read_text() for f in svc.service_files(platform, home)}
    assert not any(TOKEN in text for text in installed.values())
    moed = str(Path(sys.executable).parent / ("moed.exe" if platform == "win32" else "moed"))
    tray = str(Path(sys.executable).parent / ("moed-tray.exe" if platform == "win32" else "moed-tray"))
    if platform == "linux":
        unit = configparser.ConfigParser(interpolation=None, strict=False)
        unit.optionxform = str
        unit.read_string(installed["moed.service"])
        assert unit["Service"]["ExecStart"] == f"{moed} serve --tcp 0.0.0.0:50515"
        assert unit["Service"]["Environment"] == f'PYTHONUNBUFFERED=1 "MOED_TOKEN_FILE={token}"'
        entry = configparser.ConfigParser(interpolation=None)
        entry.optionxform = str
        entry.read_string(installed["moed-tray.desktop"])
        assert entry["Desktop Entry"]["Exec"] == f'env "MOED_TOKEN_FILE={token}" {tray}'
    elif platform == "darwin":
        daemon = plistlib.loads(installed["ai.moed.daemon.plist"].encode())
        tray_agent = plistlib.loads(installed["ai.moed.tray.plist"].encode())
        assert daemon["ProgramArguments"] == [moed, "serve", "--tcp", "0.0.0.0:50515"]
        assert daemon["EnvironmentVariables"] == {"MOED_TOKEN_FILE": str(token)}
        assert tray_agent["ProgramArguments"] == [tray]
        assert tray_agent["EnvironmentVariables"] == {"MOED_TOKEN_FILE": str(token)}
    else:
        text = installed["install-moed.ps1"]
        assert "$DaemonArguments = 'serve --tcp 0.0.0.0:50515'" in text
        assert f"$TokenFile = '{token}'" in text
        assert "-Argument $DaemonArguments" in text
        assert "SetEnvironmentVariable('MOED_TOKEN_FILE', $TokenFile, 'User')" in text
    code, out = run_cli("status", "--home", str(home), "--no-start", "--platform", platform, capsys=capsys)
    assert code == 0 and "another moed installation" not in out and out.count("installed: ") == len(installed)


def test_without_settings_the_service_files_are_as_before(tmp_path):
    files = rendered("linux", tmp_path)
    assert "MOED_TOKEN_FILE=" not in "".join(files.values()) and "@" not in "".join(files.values())
    assert "Environment=PYTHONUNBUFFERED=1\n" in files["moed.service"]
    assert "EnvironmentVariables" not in "".join(rendered("darwin", tmp_path).values())
    ps1 = rendered("win32", tmp_path)["install-moed.ps1"]
    assert "$DaemonArguments = 'serve'" in ps1 and "$TokenFile = ''" in ps1


def test_weird_token_paths_survive_each_syntax(tmp_path):
    weird = "/home/o'neil/100% \"keys\"/$tok\\en"
    settings = svc.ServiceSettings(tcp="[::1]:50515", token_file=weird)
    values = {"MOED": "/opt/moed/bin/moed", "MOED_TRAY": "/opt/moed/bin/moed-tray", "LOG_DIR": "/logs"}
    for f in svc.service_files("darwin", tmp_path):
        agent = plistlib.loads(svc.render(f, values, settings).encode())
        assert agent["EnvironmentVariables"] == {"MOED_TOKEN_FILE": weird}
    (unit_file, desktop) = svc.service_files("linux", tmp_path)
    unit = svc.render(unit_file, values, settings)
    assert 'Environment=PYTHONUNBUFFERED=1 "MOED_TOKEN_FILE=/home/o\'neil/100%% \\"keys\\"/$tok\\\\en"' in unit
    assert "ExecStart=/opt/moed/bin/moed serve --tcp [::1]:50515\n" in unit
    assert svc.is_this_installation(unit_file, unit, values)
    assert not svc.is_this_installation(unit_file, unit.replace("/opt/moed/bin/moed ", "/elsewhere/moed "), values)
    (script,) = svc.service_files("win32", tmp_path)
    text = svc.render(script, values, svc.ServiceSettings(token_file="C:\\Users\\O'Neil\\moed token"))
    assert "$TokenFile = 'C:\\Users\\O''Neil\\moed token'" in text


def test_install_refuses_a_token_file_others_can_read(tmp_path, capsys):
    home = tmp_path / "home"
    token = _token_file(tmp_path / "token", mode=0o644)
    code = main(["service", "install", "--home", str(home), "--no-start", "--platform", "linux",
                 "--token-file", str(token)])
    captured = capsys.readouterr()
    assert code == 2 and f"chmod 600 {token}" in captured.err and "Traceback" not in captured.err
    assert not home.exists()  # nothing written


def test_install_refuses_a_non_loopback_tcp_without_a_token(tmp_path, capsys):
    home = tmp_path / "home"
    code = main(["service", "install", "--home", str(home), "--no-start", "--platform", "linux",
                 "--tcp", "0.0.0.0:50515"])
    assert code == 2 and "--token-file" in capsys.readouterr().err and not home.exists()
    code = main(["service", "install", "--home", str(home), "--no-start", "--platform", "linux", "--tcp", "nope"])
    assert code == 2 and "HOST:PORT" in capsys.readouterr().err
    code, _ = run_cli("install", "--home", str(home), "--no-start", "--platform", "linux",
                      "--tcp", "127.0.0.1:50515", capsys=capsys)
    assert code == 0  # loopback needs no token


def test_systemd_analyze_verifies_a_unit_with_a_token_file(tmp_path, capsys):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    token = _token_file(tmp_path / "my keys" / "100% token")
    code, _ = run_cli("install", "--home", str(tmp_path / "home"), "--no-start", "--platform", "linux",
                      "--tcp", "0.0.0.0:50515", "--token-file", str(token), capsys=capsys)
    assert code == 0
    unit = tmp_path / "home" / ".config" / "systemd" / "user" / "moed.service"
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert TOKEN not in unit.read_text()
