"""Killed conversions leave hidden temp directories beside the destination; the next convert to the
same destination removes those whose writer is gone (and says so), never one of a live writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.tiny_models import build_tiny_model
from moed.cli.main import main
from moed.weights import ftw_writer
from moed.weights.ftw_reader import load_ftw
from moed.weights.ftw_writer import remove_stale_temp_dirs, write_ftw


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("hf") / "tiny"
    build_tiny_model("mixtral", src)
    return src


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def fake_temp_dir(parent: Path, dst_name: str, pid: int, what: str = "tmp", size: int = 3_000_000,
                  rand: str = "0123abcd") -> Path:
    d = parent / f".{dst_name}.{what}-{pid}-{rand}"
    d.mkdir()
    (d / "shard-00000.bin").write_bytes(b"\0" * size)
    return d


def test_convert_removes_stale_temp_dirs_of_dead_writers_only(tmp_path, tiny_hf, capsys):
    out = tmp_path / "out"
    gone = dead_pid()
    stale = fake_temp_dir(tmp_path, "out", gone, size=3_000_000)
    live = fake_temp_dir(tmp_path, "out", os.getpid(), rand="feedf00d")  # a conversion still running
    other_dst = fake_temp_dir(tmp_path, "other", gone)  # another destination's: not this convert's business
    lookalike = tmp_path / f".out.tmp-{gone}-not-ours"
    lookalike.mkdir()

    assert main(["convert", str(tiny_hf), str(out)]) == 0
    err = capsys.readouterr().err
    assert not stale.exists()
    assert live.is_dir() and (live / "shard-00000.bin").stat().st_size == 3_000_000
    assert other_dst.is_dir() and lookalike.is_dir()
    load_ftw(out, verify=True)
    lines = [line for line in err.splitlines() if "removed" in line]
    assert len(lines) == 1, err
    assert str(stale) in lines[0] and "3.0 MB" in lines[0] and f"pid {gone}" in lines[0]
    assert "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times come from /proc")
def test_a_reused_pid_does_not_keep_a_stale_temp_dir(tmp_path):
    """The writer died long ago and its pid now belongs to a process that started after the directory
    was last written (here: this test process, its files dated a day back): it is stale."""
    reused = fake_temp_dir(tmp_path, "m", os.getpid())
    day_ago = time.time() - 86400
    for p in (reused / "shard-00000.bin", reused):
        os.utime(p, (day_ago, day_ago))
    fresh = fake_temp_dir(tmp_path, "m", os.getpid(), rand="00000000")  # written now by this process: live
    seen = []
    removed = remove_stale_temp_dirs(tmp_path / "m", lambda path, size, pid: seen.append((path, size, pid)))
    assert removed == [(reused, 3_000_000)] and seen == [(reused, 3_000_000, os.getpid())]
    assert not reused.exists() and fresh.is_dir()


def test_old_dir_is_removed_only_once_the_destination_exists(tmp_path):
    """An .old- directory is the previous model moved aside; killed between the two renames it is the only copy."""
    old = fake_temp_dir(tmp_path, "m", dead_pid(), what="old")
    assert remove_stale_temp_dirs(tmp_path / "m") == [] and old.is_dir()
    (tmp_path / "m").mkdir()
    assert remove_stale_temp_dirs(tmp_path / "m") == [(old, 3_000_000)] and not old.exists()


def test_write_ftw_cleans_up_and_logs_without_a_reporter(tmp_path, caplog):
    stale = fake_temp_dir(tmp_path, "m", dead_pid())
    with caplog.at_level("WARNING", logger="moed.weights"):
        write_ftw(tmp_path / "m", {"a": ("weight", torch.ones(4))}, metadata={}, source_fingerprint="x")
    assert not stale.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert any(str(stale) in r.getMessage() for r in caplog.records)


def test_a_symlink_named_like_a_temp_dir_is_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / f".m.tmp-{dead_pid()}-0123abcd"
    link.symlink_to(target, target_is_directory=True)
    assert remove_stale_temp_dirs(tmp_path / "m") == []
    assert (target / "keep").is_file() and link.is_symlink()


def test_pid_checks():
    assert ftw_writer._writer_may_be_alive(os.getpid(), time.time())
    assert not ftw_writer._writer_may_be_alive(dead_pid(), time.time())
    if os.path.exists("/proc/self/stat"):
        started = ftw_writer._process_start_time(os.getpid())
        assert started is not None and started <= time.time() + 2


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory) -> Path:
    """A model whose conversion takes long enough to be killed in the middle (~150 MB of experts)."""
    import transformers as tf

    from helpers.tiny_models import COMMON

    src = tmp_path_factory.mktemp("big") / "big"
    config = tf.MixtralConfig(**dict(COMMON, hidden_size=512), intermediate_size=1024, num_key_value_heads=2,
                              num_local_experts=8, num_experts_per_tok=2)
    with torch.no_grad():
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(src)
    return src


def test_next_convert_cleans_up_after_a_killed_convert(tmp_path, big_hf):
    """SIGKILL a real `moed convert` while it writes shards; the next convert to the same destination
    removes what it left, says so, and writes a loadable model."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "moed.cli.main", "convert", str(big_hf), str(out)]
    leftover = None
    for _attempt in range(3):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            temps = [p for p in tmp_path.glob(f".out.tmp-{proc.pid}-*") if any(p.glob("shard-*"))]
            if temps and any(s.stat().st_size > 0 for s in temps[0].glob("shard-*")):
                proc.send_signal(signal.SIGKILL)
                leftover = temps[0]
                break
            time.sleep(0.002)
        proc.wait()
        proc.stderr.close()
        if leftover is not None:
            break
        assert proc.returncode == 0, "the conversion failed on its own"
        subprocess.run(["rm", "-rf", str(out)], check=True)  # it finished before we saw it write: again
    else:
        pytest.skip("the conversion always finished before it could be killed mid-write")
    assert proc.returncode == -signal.SIGKILL
    assert leftover.is_dir() and not out.exists()
    size = sum(p.stat().st_size for p in leftover.iterdir())

    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (line,) = [line for line in result.stderr.splitlines() if "removed" in line]
    assert str(leftover) in line and f"pid {proc.pid}" in line
    assert (f"{size / 1e6:.1f} MB" if size < 100e6 else f"{size / 1e9:.2f} GB") in line
    load_ftw(out, verify=True)
