"""The checked-in stubs (daemon/v1, imported as moed.v1) are what `make proto` generates now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_not_stale(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    checked_in = ROOT / "daemon" / "v1"
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(p.name for p in checked_in.iterdir() if p.is_file()), "stub file set differs: run make proto"
    for name in fresh:
        assert (tmp_path / name).read_bytes() == (checked_in / name).read_bytes(), (
            f"daemon/v1/{name} is stale: run `make proto` after editing protos/")
