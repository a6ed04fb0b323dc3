"""One daemon per user: a second lock fails naming the first one's address; death releases it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from moed.errors import AlreadyRunningError, MoedError
from moed.service.instance_lock import InstanceLock, read_lock_holder

pytestmark = pytest.mark.skipif(sys.platform.startswith("win"), reason="POSIX flock semantics")

HOLDER = textwrap.dedent("""
    import sys
    from moed.service.instance_lock import InstanceLock
    lock = InstanceLock(sys.argv[1]).acquire()
    lock.update_address(sys.argv[2])
    print("locked", flush=True)
    sys.stdin.readline()  # hold until told (or killed)
    if sys.argv[3] == "release":
        lock.release()
        print("released", flush=True)
        sys.stdin.readline()
""")

TRY = textwrap.dedent("""
    import sys
    from moed.errors import AlreadyRunningError
    from moed.service.instance_lock import InstanceLock
    try:
        InstanceLock(sys.argv[1]).acquire("unix:///second.sock")
    except AlreadyRunningError as exc:
        print("refused:", exc)
        sys.exit(3)
    print("acquired")
""")


def start_holder(lock_path, address, mode="hold"):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock_path), address, mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_start_names_the_first_ones_pid_and_address(tmp_path):
    lock_path = tmp_path / "moed.lock"
    address = "unix:///run/user/1000/moed/moed.sock"
    holder = start_holder(lock_path, address)
    try:
        with pytest.raises(AlreadyRunningError) as info:
            InstanceLock(lock_path).acquire()
        message = str(info.value)
        assert f"(pid {holder.pid})" in message and f"on {address}" in message
        assert message.startswith("moed is already running")
        assert info.value.pid == holder.pid and info.value.address == address
        assert isinstance(info.value, MoedError)
    finally:
        holder.kill()
        holder.wait()


def test_lock_is_released_when_the_holder_dies(tmp_path):
    lock_path = tmp_path / "moed.lock"
    holder = start_holder(lock_path, "unix:///a.sock")
    os.kill(holder.pid, signal.SIGKILL)  # a crash: no cleanup runs
    holder.wait()
    assert read_lock_holder(lock_path).pid == holder.pid  # the stale file is still there...
    with InstanceLock(lock_path).acquire("unix:///b.sock"):  # ...and does not block the next daemon
        holder_now = read_lock_holder(lock_path)
        assert (holder_now.pid, holder_now.address) == (os.getpid(), "unix:///b.sock")


def test_release_lets_another_process_in_and_clears_the_file(tmp_path):
    lock_path = tmp_path / "moed.lock"
    holder = start_holder(lock_path, "unix:///a.sock", mode="release")
    try:
        with pytest.raises(AlreadyRunningError):
            InstanceLock(lock_path).acquire()
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        assert read_lock_holder(lock_path) is None
        lock = InstanceLock(lock_path).acquire()
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_a_process_that_holds_the_lock_blocks_a_second_process(tmp_path):
    lock_path = tmp_path / "moed.lock"
    lock = InstanceLock(lock_path).acquire()
    try:
        result = subprocess.run([sys.executable, "-c", TRY, str(lock_path)], capture_output=True, text=True)
        assert result.returncode == 3, result.stderr
        assert f"(pid {os.getpid()}), still starting" in result.stdout  # no address yet
        lock.update_address("unix:///tmp/x/moed.sock")
        result = subprocess.run([sys.executable, "-c", TRY, str(lock_path)], capture_output=True, text=True)
        assert "on unix:///tmp/x/moed.sock" in result.stdout
        data = json.loads(lock_path.read_text())
        assert data["pid"] == os.getpid() and data["started"]
    finally:
        lock.release()
    result = subprocess.run([sys.executable, "-c", TRY, str(lock_path)], capture_output=True, text=True)
    assert result.returncode == 0 and "acquired" in result.stdout


def test_update_address_on_a_released_lock_is_refused(tmp_path):
    lock = InstanceLock(tmp_path / "moed.lock")
    with pytest.raises(RuntimeError, match="not held"):
        lock.update_address("unix:///x.sock")


def test_a_daemon_that_died_holding_the_lock_is_named_in_one_line_logged_and_printed(tmp_path, capsys, caplog):
    lock_path = tmp_path / "moed.lock"
    holder = start_holder(lock_path, "unix:///a.sock")
    os.kill(holder.pid, signal.SIGKILL)  # no release: its JSON stays in the file
    holder.wait()
    with caplog.at_level("WARNING", logger="moed.service.lock"):
        lock = InstanceLock(lock_path).acquire("unix:///b.sock")
    try:
        assert lock.recovered_from is not None and lock.recovered_from.pid == holder.pid
        assert lock.recovered_from.address == "unix:///a.sock"
        expected = f"recovered a stale lock left by pid {holder.pid} (not running)"
        printed = capsys.readouterr().out.splitlines()
        assert len(printed) == 1 and expected in printed[0] and "unix:///a.sock" in printed[0]
        logged = [r.getMessage() for r in caplog.records if r.name == "moed.service.lock"]
        assert len(logged) == 1 and expected in logged[0] and "\n" not in logged[0]
        assert read_lock_holder(lock_path).pid == os.getpid()  # and the file now names us
    finally:
        lock.release()


def test_a_cleanly_released_lock_or_a_fresh_file_is_not_called_stale(tmp_path, capsys):
    lock_path = tmp_path / "moed.lock"
    first = InstanceLock(lock_path).acquire("unix:///a.sock")
    assert first.recovered_from is None
    first.release()
    second = InstanceLock(lock_path).acquire()
    try:
        assert second.recovered_from is None
        assert "stale" not in capsys.readouterr().out
    finally:
        second.release()


def test_a_stale_pid_reused_by_another_process_is_said_so_and_announce_false_is_quiet(tmp_path, capsys):
    lock_path = tmp_path / "moed.lock"
    alive = os.getppid()  # running, but not holding the lock: the dead daemon's pid was reused
    lock_path.write_text(json.dumps({"pid": alive, "address": None, "started": "2024-01-01T00:00:00+00:00"}))
    lock = InstanceLock(lock_path).acquire(announce=False)
    try:
        assert lock.recovered_from.pid == alive
        assert capsys.readouterr().out == ""
    finally:
        lock.release()
    lock_path.write_text(json.dumps({"pid": alive, "address": None, "started": ""}))
    with InstanceLock(lock_path) as lock:
        out = capsys.readouterr().out
        assert f"recovered a stale lock left by pid {alive} (that pid now belongs to another process)" in out
    lock_path.write_text("not json at all")  # unreadable leftovers: taken over quietly
    with InstanceLock(lock_path) as lock:
        assert lock.recovered_from is None and capsys.readouterr().out == ""
