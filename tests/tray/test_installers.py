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
