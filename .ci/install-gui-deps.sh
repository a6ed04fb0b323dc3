#!/usr/bin/env bash
# Desktop test dependencies for tests/tray/test_tray_gui.py: a virtual X server (Xvfb), a tray host
# (trayer), GTK 3 + its Python bindings for pystray's gtk backend, a session bus, xdotool and ImageMagick.
# Idempotent and quick on a second run: apt runs only when a package is missing, pip only when the venv
# cannot import gi. Run it after the venv exists (`make venv`); VENV overrides the venv path.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PACKAGES=(xvfb trayer python3-gi gir1.2-gtk-3.0 gir1.2-ayatanaappindicator3-0.1 libgirepository1.0-dev
          libcairo2-dev pkg-config dbus-x11 xdotool imagemagick)

missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    echo "install-gui-deps: apt-get install ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
else
    echo "install-gui-deps: system packages already installed"
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "install-gui-deps: no venv at $VENV yet; run \`make venv\` then this script again for PyGObject" >&2
    exit 0
fi
if ! "$VENV/bin/python" -c "import gi, PIL, importlib.util as u; assert u.find_spec('pystray')" >/dev/null 2>&1; then
    # <3.51: 3.51+ needs a newer glib than Debian 12 ships; it builds against the -dev packages above
    echo "install-gui-deps: pip install PyGObject<3.51 pystray pillow"
    "$VENV/bin/pip" install -q "PyGObject<3.51" pystray pillow
else
    echo "install-gui-deps: PyGObject already in $VENV"
fi
