"""The daemon killed at the worst moments (SIGKILL: no handler, no clean-up): mid-generation and
mid-load. The next `moed serve` on the same socket starts cleanly, serves, and says in one line,
on its output and in its log, that it recovered the stale lock the dead one left."""

from __future__ import annotations

import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from helpers.daemon_process import start_daemon
from helpers.tiny_models import build_tiny_model
from helpers.tiny_tokenizer import write_tiny_tokenizer
from moed.api.client import DaemonUnavailableError
from moed.service.instance_lock import read_lock_holder
from moed.v1 import control_pb2, control_pb2_grpc

pytestmark = pytest.mark.skipif(sys.platform.startswith("win"), reason="SIGKILL and unix sockets")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """tiny, and medium: ~100 MB of fp32 weights, so a load takes a few hundred milliseconds."""
    import transformers as tf

    root = tmp_path_factory.mktemp("fault-models")
    build_tiny_model("mixtral", root / "tiny")
    write_tiny_tokenizer(root / "tiny")
    torch.manual_seed(0)
    config = tf.MixtralConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=1024, num_local_experts=8,
                              num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(root / "medium")
    write_tiny_tokenizer(root / "medium")
    return root


def lock_path(d):
    return d.socket.with_name(d.socket.name + ".lock")


def output_since(d, offset: int) -> str:
    return (d.home / "daemon.out").read_bytes()[offset:].decode(errors="replace")


def restart_and_check_recovery(d, killed_pid: int, models_dir):
    """The stale lock and socket are still there; the next start on the same socket takes over and says so."""
    holder = read_lock_holder(lock_path(d))
    assert holder is not None and holder.pid == killed_pid, "the killed daemon's lock file is not what it left"
    assert d.socket.exists(), "the killed daemon's socket file should still be there (nothing cleaned up)"
    offset = (d.home / "daemon.out").stat().st_size
    log_offset = (d.home / "logs" / "moed.log").stat().st_size
    started = time.monotonic()
    again = start_daemon(d.home, "--model", "tiny", models_dir=models_dir)
    deadline = time.monotonic() + 60
    while again.health() != SERVING:
        assert time.monotonic() < deadline, output_since(again, offset)
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    said = f"recovered a stale lock left by pid {killed_pid} (not running)"
    printed = output_since(again, offset)
    logged = (d.home / "logs" / "moed.log").read_bytes()[log_offset:].decode(errors="replace")
    assert [line for line in printed.splitlines() if said in line], printed
    assert [line for line in logged.splitlines() if said in line], logged
    with again.client() as client:
        parts = list(client.generate(prompt="The router reads", model="tiny", max_tokens=4, ignore_eos=True))
        assert parts[-1].done and sum(len(p.token_ids) for p in parts) == 4
    assert read_lock_holder(lock_path(again)).pid == again.proc.pid
    return again, elapsed


def test_sigkill_mid_generation_then_a_clean_restart_that_says_it_recovered(tmp_path, models_dir):
    d = start_daemon(tmp_path / "home", "--model", "tiny", models_dir=models_dir)
    deadline = time.monotonic() + 60
    while d.health() != SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    errors: list = []
    with d.client() as client:
        stream = client.generate(prompt="The router reads", model="tiny", max_tokens=250, ignore_eos=True)
        next(stream)
        next(stream)  # tokens are flowing
        assert client.status().active_requests == 1
        pid = d.proc.pid
        assert d.kill() == -9
        started = time.monotonic()
        try:
            for _ in stream:
                pass
        except Exception as exc:  # the client hears about it (UNAVAILABLE), it does not hang
            errors.append(exc)
        assert time.monotonic() - started < 10
    assert errors and isinstance(errors[0], DaemonUnavailableError), errors  # the client's UNAVAILABLE
    again, elapsed = restart_and_check_recovery(d, pid, models_dir)
    print(f"restart after SIGKILL mid-generation: SERVING in {elapsed:.1f} s")
    # a clean stop releases the lock: the start after it has nothing to recover
    assert again.stop() == 0
    assert read_lock_holder(lock_path(again)) is None
    offset = (d.home / "daemon.out").stat().st_size
    third = start_daemon(d.home, models_dir=models_dir)
    try:
        assert "recovered a stale lock" not in output_since(third, offset)
    finally:
        assert third.stop() == 0


def test_sigkill_mid_load_then_a_clean_restart_that_says_it_recovered(tmp_path, models_dir):
    d = start_daemon(tmp_path / "home", models_dir=models_dir)
    seen: list[str] = []
    failure: list = []
    with grpc.insecure_channel(d.address) as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        stream = stub.LoadModel(control_pb2.LoadModelRequest(model="medium", name="medium"), timeout=60)
        seen.append(next(stream).stage)
        assert seen == ["queued"]
        assert d.health() == NOT_SERVING, "no load in flight to interrupt"
        pid = d.proc.pid
        assert d.kill() == -9

        def drain():
            try:
                for progress in stream:
                    seen.append(progress.stage)
            except grpc.RpcError as exc:
                failure.append(exc.code())

        reader = threading.Thread(target=drain)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "the client of an interrupted load hangs"
    assert "ready" not in seen, f"the load finished before the kill ({seen}): make the model bigger"
    assert failure == [grpc.StatusCode.UNAVAILABLE], failure
    again, elapsed = restart_and_check_recovery(d, pid, models_dir)
    print(f"restart after SIGKILL mid-load: SERVING in {elapsed:.1f} s")
    try:
        with again.client() as client:  # the model the dead daemon was loading loads now
            final = None
            for final in client.load("medium", name="medium"):
                pass
            assert final.model.loaded and final.model.name == "medium"
    finally:
        assert again.stop() == 0


def test_sigkill_during_the_initial_model_load(tmp_path, models_dir):
    d = start_daemon(tmp_path / "home", "--model", "medium", models_dir=models_dir, wait=False)
    deadline = time.monotonic() + 60
    while True:  # bound and answering, but not SERVING: the initial load is running
        assert d.proc.poll() is None and time.monotonic() < deadline
        try:
            if d.socket.exists() and d.health() == NOT_SERVING:
                break
        except grpc.RpcError:
            pass
        time.sleep(0.005)
    pid = d.proc.pid
    assert d.kill() == -9
    again, _ = restart_and_check_recovery(d, pid, models_dir)
    assert again.stop() == 0
