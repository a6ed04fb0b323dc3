"""`moed service install|uninstall|status`: the login service (daemon) and tray autostart for this user.

The templates live in installers/ at the repository root; `@MOED@`, `@MOED_TRAY@` and `@LOG_DIR@` are
filled with this installation's absolute paths, escaped for each file's syntax. The service settings
(`--tcp`, `--token-file`) fill `@SERVE_ARGS@` / `@DAEMON_ARGUMENTS@` (arguments after `moed serve`) and
`@TOKEN_ENV@` / `@TOKEN_FILE@` (MOED_TOKEN_FILE in the environment of the daemon and the tray). A token
is never written into these files nor onto a command line: only the path of the file that holds it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape as xml_escape

from moed.errors import MoedError

INSTALLERS_DIR = Path(__file__).resolve().parents[2] / "installers"
SYSTEMD_UNIT = "moed.service"
LAUNCHD_LABELS = ("ai.moed.daemon", "ai.moed.tray")
WINDOWS_TASKS = ("moed daemon", "moed tray")


@dataclass(frozen=True)
class ServiceSettings:
    """How the installed daemon runs: an extra TCP listener, and the file its token is read from."""

    tcp: str | None = None  # HOST:PORT
    token_file: str | None = None  # absolute path; the token itself is never written anywhere

    def serve_args(self) -> list[str]:
        return ["--tcp", self.tcp] if self.tcp else []


SETTING_KEYS = ("SERVE_ARGS", "DAEMON_ARGUMENTS", "TOKEN_ENV", "TOKEN_FILE")


@dataclass(frozen=True)
class ServiceFile:
    template: str  # path under installers/
    target: Path  # where it is installed
    syntax: str  # systemd | desktop | plist | powershell: how placeholders are escaped


def add_service_command(sub) -> None:
    svc = sub.add_parser("service", help="start the daemon (and tray) at login for this user: install, "
                         "uninstall or status")
    svc.add_argument("action", choices=("install", "uninstall", "status"))
    svc.add_argument("--home", metavar="DIR", help="the home directory to install under (default $HOME)")
    svc.add_argument("--no-start", action="store_true",
                     help="only write/remove the files; do not run systemctl / powershell (print the commands)")
    svc.add_argument("--platform", choices=("linux", "darwin", "win32"), default=None,
                     help="write another platform's files (default: this machine's)")
    svc.add_argument("--tcp", metavar="HOST:PORT", help="install: the daemon also listens on HOST:PORT "
                     "(anything but loopback needs --token-file)")
    svc.add_argument("--token-file", metavar="PATH",
                     help="install: the daemon (and the tray) read the token from this file, named as "
                          "MOED_TOKEN_FILE in their environment; the token is never written into the service "
                          "files nor onto a command line. The file must be private to you (chmod 600)")


def platform_family(platform: str) -> str:
    if platform.startswith("win"):
        return "win32"
    if platform == "darwin":
        return "darwin"
    return "linux"


def service_files(platform: str, home: Path) -> list[ServiceFile]:
    family = platform_family(platform)
    if family == "linux":
        return [ServiceFile("linux/moed.service", home / ".config" / "systemd" / "user" / SYSTEMD_UNIT, "systemd"),
                ServiceFile("linux/moed-tray.desktop", home / ".config" / "autostart" / "moed-tray.desktop", "desktop")]
    if family == "darwin":
        agents = home / "Library" / "LaunchAgents"
        return [ServiceFile(f"macos/{label}.plist", agents / f"{label}.plist", "plist") for label in LAUNCHD_LABELS]
    return [ServiceFile("windows/install-moed.ps1", home / "AppData" / "Local" / "moed" / "install-moed.ps1",
                        "powershell")]


def log_dir_for(platform: str, home: Path) -> Path:
    family = platform_family(platform)
    if family == "darwin":
        return home / "Library" / "Logs" / "moed"
    if family == "win32":
        return home / "AppData" / "Local" / "moed" / "logs"
    return home / ".local" / "state" / "moed" / "logs"


def executables(platform: str) -> dict[str, str]:
    """Absolute paths of this installation's `moed` and `moed-tray` (the console scripts beside python).
    For another platform's files (--platform) the paths are written as they would be there, unchecked."""
    suffix = ".exe" if platform_family(platform) == "win32" else ""
    bin_dir = Path(sys.executable).parent
    is_here = platform_family(platform) == platform_family(sys.platform)
    found = {}
    for key, name in (("MOED", "moed"), ("MOED_TRAY", "moed-tray")):
        path = bin_dir / f"{name}{suffix}"
        if is_here and not path.exists():
            which = shutil.which(name)
            if which is None:
                raise MoedError(f"the `{name}` command was not found beside {sys.executable} nor on PATH; "
                                "install moed with pip (which creates it), then run `moed service install` again")
            path = Path(which)
        found[key] = str(path.absolute())
    return found


def quote_for(syntax: str, value: str) -> str:
    """Escape a path for one file syntax (the template leaves the placeholder bare)."""
    if syntax == "plist":
        return xml_escape(value)
    if syntax == "powershell":  # inside a single-quoted string
        return value.replace("'", "''")
    if syntax == "systemd":  # % is a specifier; quote paths with spaces
        value = value.replace("%", "%%")
        return f'"{value}"' if any(c in value for c in ' "\\') and not value.startswith('"') else value
    if syntax == "desktop":  # Exec field codes and reserved characters
        value = value.replace("%", "%%")
        if any(c in value for c in ' \t"\'\\><~|&;$*?#()`'):
            escaped = "".join("\\" + c if c in '"`$\\' else c for c in value)
            return f'"{escaped}"'
        return value
    raise ValueError(f"unknown syntax {syntax!r}")


def systemd_quoted(value: str) -> str:
    """A double-quoted systemd word: backslash and quote escaped, % (a specifier) doubled."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def systemd_arg(value: str) -> str:
    """One ExecStart argument: bare when plain, else quoted; $ (a variable there) doubled."""
    if re.fullmatch(r"[A-Za-z0-9_./:,+=@\[\]-]+", value):
        return value
    return systemd_quoted(value.replace("$", "$$"))


def setting_fragments(syntax: str, settings: ServiceSettings) -> dict[str, str]:
    """The text each settings placeholder becomes in a file of ``syntax`` (empty when unset)."""
    args, token_file = settings.serve_args(), settings.token_file
    if syntax == "systemd":
        return {"SERVE_ARGS": "".join(" " + systemd_arg(a) for a in args),
                "TOKEN_ENV": " " + systemd_quoted("MOED_TOKEN_FILE=" + token_file) if token_file else ""}
    if syntax == "desktop":  # Exec=env MOED_TOKEN_FILE=... moed-tray
        return {"TOKEN_ENV": f"env {quote_for('desktop', 'MOED_TOKEN_FILE=' + token_file)} " if token_file else ""}
    if syntax == "plist":
        env = ("\n  <key>EnvironmentVariables</key>\n  <dict>\n    <key>MOED_TOKEN_FILE</key>\n"
               f"    <string>{xml_escape(token_file)}</string>\n  </dict>") if token_file else ""
        return {"SERVE_ARGS": "".join(f"\n    <string>{xml_escape(a)}</string>" for a in args), "TOKEN_ENV": env}
    if syntax == "powershell":
        return {"DAEMON_ARGUMENTS": quote_for("powershell", subprocess.list2cmdline(["serve", *args])),
                "TOKEN_FILE": quote_for("powershell", token_file or "")}
    raise ValueError(f"unknown syntax {syntax!r}")


def _template_text(service_file: ServiceFile) -> str:
    template = INSTALLERS_DIR / service_file.template
    if not template.is_file():
        raise MoedError(f"installer template {template} is missing; `moed service` needs the installers/ folder "
                        "of a moed source checkout")
    return template.read_text()


def render(service_file: ServiceFile, values: dict[str, str], settings: ServiceSettings = ServiceSettings()) -> str:
    text = _template_text(service_file)
    for key, value in values.items():
        text = text.replace(f"@{key}@", quote_for(service_file.syntax, value))
    for key, fragment in setting_fragments(service_file.syntax, settings).items():
        text = text.replace(f"@{key}@", fragment)
    return text


def is_this_installation(service_file: ServiceFile, text: str, values: dict[str, str]) -> bool:
    """Whether an installed file is this template with these paths, whatever service settings it has."""
    parts = re.split(r"@([A-Z_]+)@", _template_text(service_file))
    pattern = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            pattern.append(re.escape(part))
        elif part in values:
            pattern.append(re.escape(quote_for(service_file.syntax, values[part])))
        elif part in SETTING_KEYS:
            pattern.append("(?s:.*?)")
        else:
            pattern.append(re.escape(f"@{part}@"))
    return re.fullmatch("".join(pattern), text) is not None


def service_settings(platform: str, tcp: str | None, token_file: str | None) -> ServiceSettings:
    """Check the settings before anything is written (a daemon that cannot start would restart forever)."""
    from moed import config

    if tcp is not None:
        host, sep, port = tcp.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise MoedError(f"--tcp {tcp!r}: write HOST:PORT, e.g. 127.0.0.1:50515")
    path = None
    if token_file is not None:
        if platform_family(platform) == platform_family(sys.platform):
            path = str(Path(os.path.expanduser(token_file)).absolute())
            config.read_token_file(path)  # readable, private, one line: else a one-line error now
        else:
            path = token_file  # another platform's path: written as given, unchecked
    if tcp is not None and path is None:
        from moed.api.auth import is_loopback_host

        if not is_loopback_host(tcp.rpartition(":")[0]):
            raise MoedError(f"--tcp {tcp}: listening beyond this machine needs a token; pass --token-file PATH "
                            "(a file holding the token, chmod 600)")
    return ServiceSettings(tcp=tcp, token_file=path)


def install(platform: str, home: Path, *, start: bool, out=None,
            settings: ServiceSettings = ServiceSettings()) -> int:
    out = out or sys.stdout
    values = dict(executables(platform), LOG_DIR=str(log_dir_for(platform, home)))
    files = service_files(platform, home)
    for f in files:
        f.target.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.target.with_name(f.target.name + ".tmp")
        tmp.write_text(render(f, values, settings))
        tmp.replace(f.target)
        print(f"wrote {f.target}", file=out)
    if settings.tcp:
        print(f"the daemon will also listen on {settings.tcp}", file=out)
    if settings.token_file:
        print(f"the daemon and the tray read the token from {settings.token_file} (MOED_TOKEN_FILE in their "
              f"environment); for the moed command: export MOED_TOKEN_FILE={settings.token_file}", file=out)
    family = platform_family(platform)
    if family == "linux":
        return _run_or_print([["systemctl", "--user", "daemon-reload"],
                              ["systemctl", "--user", "enable", "--now", SYSTEMD_UNIT]], start, "systemctl", out)
    if family == "darwin":
        log_dir_for(platform, home).mkdir(parents=True, exist_ok=True)
        print("to start them now (they also start at your next login):", file=out)
        for f in files:
            print(f"  launchctl load -w {f.target}", file=out)
        return 0
    command = ["powershell", "-NoProfile", "-ExecutionPolicy", "Bypass", "-File", str(files[0].target)]
    return _run_or_print([command], start, "powershell", out)


def uninstall(platform: str, home: Path, *, start: bool, out=None) -> int:
    out = out or sys.stdout
    family = platform_family(platform)
    status = 0
    if family == "linux":
        status = _run_or_print([["systemctl", "--user", "disable", "--now", SYSTEMD_UNIT]], start, "systemctl", out)
    elif family == "win32":
        script = service_files(platform, home)[0].target
        if script.exists():  # its -Uninstall also removes the MOED_TOKEN_FILE it set
            command = ["powershell", "-NoProfile", "-ExecutionPolicy", "Bypass", "-File", str(script), "-Uninstall"]
        else:
            tasks = ",".join(f"'{t}'" for t in WINDOWS_TASKS)
            command = ["powershell", "-NoProfile", "-Command",
                       f"Unregister-ScheduledTask -TaskName {tasks} -Confirm:$false"]
        status = _run_or_print([command], start, "powershell", out)
    removed = 0
    for f in service_files(platform, home):
        if f.target.exists():
            f.target.unlink()
            removed += 1
            print(f"removed {f.target}", file=out)
    if family == "linux" and removed:
        _run_or_print([["systemctl", "--user", "daemon-reload"]], start, "systemctl", out)
    if family == "darwin":
        print("to stop the running agents now:", file=out)
        for label in LAUNCHD_LABELS:
            print(f"  launchctl remove {label}", file=out)
    if not removed:
        print("nothing was installed", file=out)
    return status


def status(platform: str, home: Path, *, start: bool, out=None) -> int:
    out = out or sys.stdout
    try:
        values = dict(executables(platform), LOG_DIR=str(log_dir_for(platform, home)))
    except MoedError:
        values = None
    for f in service_files(platform, home):
        if not f.target.exists():
            print(f"not installed: {f.target}", file=out)
        elif values is not None and not is_this_installation(f, f.target.read_text(), values):
            print(f"installed (for another moed installation; `moed service install` rewrites it): {f.target}", file=out)
        else:
            print(f"installed: {f.target}", file=out)
    if platform_family(platform) == "linux" and start and shutil.which("systemctl"):
        for verb in ("is-enabled", "is-active"):
            result = _systemctl_quiet(["systemctl", "--user", verb, SYSTEMD_UNIT])
            print(f"systemctl --user {verb} {SYSTEMD_UNIT}: {result}", file=out)
    return 0


def _systemctl_quiet(command: list[str]) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    return (result.stdout.strip() or result.stderr.strip() or f"exit {result.returncode}").splitlines()[0]


def _run_or_print(commands: list[list[str]], start: bool, tool: str, out) -> int:
    """Run the commands when asked and the tool exists; otherwise print them for the user."""
    shown = "\n".join("  " + subprocess.list2cmdline(c) if tool == "powershell" else "  " + " ".join(c)
                      for c in commands)
    if not start or shutil.which(tool) is None:
        reason = "files only" if not start else f"{tool} is not available here"
        print(f"not run ({reason}); to apply, run:\n{shown}", file=out)
        return 0
    for command in commands:
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"could not run {' '.join(command)}: {exc}\nrun it yourself:\n{shown}", file=out)
            return 1
        if result.returncode != 0:
            print(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}\n"
                  f"the files are in place; fix the problem above and run:\n{shown}", file=out)
            return 1
        print(f"ran: {' '.join(command)}", file=out)
    return 0


def run_service(args: argparse.Namespace) -> int:
    platform = args.platform or sys.platform
    home = Path(args.home).expanduser().absolute() if args.home else Path.home()
    start = not args.no_start
    if platform_family(platform) != platform_family(sys.platform):
        start = False  # another platform's files: nothing here can apply them
    if args.action != "install":
        if args.tcp or args.token_file:
            raise MoedError(f"--tcp and --token-file go with `moed service install`, not {args.action}")
        return {"uninstall": uninstall, "status": status}[args.action](platform, home, start=start)
    settings = service_settings(platform, args.tcp, args.token_file)
    return install(platform, home, start=start, settings=settings)
