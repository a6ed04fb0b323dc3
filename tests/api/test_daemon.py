"""The daemon as users and local apps see it: a real `moed serve` process on a temporary socket."""

from __future__ import annotations

import os
import socket as socketlib
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from helpers.daemon_process import start_daemon
from helpers.tiny_models import build_tiny_model_dir
from moed.api.client import DaemonCallError, DaemonUnavailableError, MoedClient

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPTS = ["The router reads", "A small expert", "The daemon loads the weights", "Every token", "The GPU",
           "Our cache keeps", "The user writes", "The scheduler finds"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, models_dir):
    d = start_daemon(tmp_path_factory.mktemp("home"), models_dir=models_dir)
    yield d
    assert d.stop() == 0, (d.home / "daemon.out").read_text()


def collect(client: MoedClient, prompt: str, model: str = "", **kw) -> tuple[str, list[int], str]:
    text, ids, reason = [], [], ""
    for part in client.generate(prompt=prompt, model=model, **kw):
        text.append(part.text)
        ids.extend(part.token_ids)
        if part.done:
            reason = part.finish_reason
    return "".join(text), ids, reason


def _wait_until(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def load(client: MoedClient, model: str, **options):
    final = None
    for progress in client.load(model, **options):
        final = progress
    return final.model


def test_health_is_not_serving_while_loading_and_reflection_lists_services(daemon):
    seen = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                seen.append(daemon.health())
            except grpc.RpcError:
                pass
            time.sleep(0.002)

    with daemon.client() as client:
        poller = threading.Thread(target=poll)
        poller.start()
        try:
            info = load(client, "tiny", name="health-probe", device="emulated", experts_dtype="int4")
        finally:
            stop.set()
            poller.join()
        assert info.loaded and info.name == "health-probe"
        assert NOT_SERVING in seen, "health never reported NOT_SERVING during the load"
        assert daemon.health() == SERVING
        assert daemon.health("moed.v1.Inference") == SERVING
        client.unload("health-probe")
    with grpc.insecure_channel(daemon.address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"moed.v1.Inference", "moed.v1.Control", "grpc.health.v1.Health"} <= set(services)


def test_eight_concurrent_streams_equal_their_single_runs(daemon):
    with daemon.client() as client:
        load(client, "tiny", name="main", max_batch=8)
        alone = {p: collect(client, p, "main", max_tokens=24, ignore_eos=True) for p in PROMPTS}
        results: dict[str, tuple] = {}

        def worker(prompt: str) -> None:
            with daemon.client() as own:
                results[prompt] = collect(own, prompt, "main", max_tokens=24, ignore_eos=True)

        threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(results) == set(PROMPTS)
        for prompt in PROMPTS:
            assert results[prompt] == alone[prompt], prompt
            assert results[prompt][2] == "length" and len(results[prompt][1]) == 24


def test_cancel_mid_stream_frees_the_request(daemon):
    with daemon.client() as client:
        if "main" not in {m.name for m in client.status().models}:
            load(client, "tiny", name="main")
        stream = client.generate(prompt="The router reads", model="main", request_id="to-cancel",
                                 max_tokens=200, ignore_eos=True)
        first = next(stream)
        assert first.request_id == "to-cancel"
        assert client.cancel("to-cancel")
        reasons = [part.finish_reason for part in stream if part.done]
        assert reasons == ["cancelled"]
        deadline = time.monotonic() + 10
        while client.status().active_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status().active_requests == 0


def test_load_and_unload_while_another_model_generates(daemon):
    with daemon.client() as client:
        if "main" not in {m.name for m in client.status().models}:
            load(client, "tiny", name="main")
        expected = collect(client, "The GPU", "main", max_tokens=64, ignore_eos=True)
        result = {}
        worker = threading.Thread(target=lambda: result.update(
            out=collect(daemon.client(), "The GPU", "main", max_tokens=64, ignore_eos=True)))
        worker.start()
        load(client, "tiny", name="second", device="emulated")
        assert collect(client, "Every token", "second", max_tokens=4)[1]
        engine = client.status().engine  # the most recently used model: "second", on the emulated device
        assert engine.device == "emulated" and engine.model_device_bytes > 0 and not engine.model_note
        # the KV pool of that model: sized to two contexts by default, its prompt counted, the cache on
        assert engine.kv_blocks > 0 and engine.kv_block_size == 16 and engine.kv_bytes > 0 and engine.prefix_cache
        assert engine.prompt_tokens > 0 and engine.kv_used_blocks <= engine.kv_blocks
        assert client.unload("second")
        worker.join(120)
        assert result["out"] == expected


def test_full_queue_answers_resource_exhausted(daemon):
    with daemon.client() as client:
        load(client, "tiny", name="narrow", max_batch=1, max_queue=1)
        running = client.generate(prompt="The router reads", model="narrow", max_tokens=400, ignore_eos=True)
        next(running)
        queued = client.generate(prompt="A small expert", model="narrow", max_tokens=4)
        outcome = {}

        def drain():
            try:
                outcome["chunks"] = list(queued)
            except DaemonCallError as exc:
                outcome["error"] = exc

        waiter = threading.Thread(target=drain, daemon=True)
        waiter.start()
        _wait_until(lambda: client.status().queued_requests == 1, "the second request to be queued")
        with pytest.raises(DaemonCallError) as info:
            collect(client, "The GPU", "narrow", max_tokens=4)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        client.unload("narrow")
        waiter.join(60)  # the queued request ends with the unload, before the channel closes
        assert not waiter.is_alive()
        assert "error" not in outcome, outcome.get("error")
        last = outcome["chunks"][-1]  # the unload ends it cleanly: a final chunk that says why
        assert last.done and last.finish_reason == "cancelled", last


@pytest.mark.parametrize("kwargs,code", [
    (dict(prompt="hello", model="no-such-model"), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt="hello", model="main", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt="hello", model="main", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt="the weights " * 400, model="main"), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(messages=[], model="main"), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt="", model="main"), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_requests_get_the_right_status_and_the_daemon_keeps_serving(daemon, kwargs, code):
    with daemon.client() as client:
        if "main" not in {m.name for m in client.status().models}:
            load(client, "tiny", name="main", context_length=256)
        with pytest.raises(DaemonCallError) as info:
            list(client.generate(max_tokens=4, **kwargs))
        assert info.value.code == code, info.value
        assert collect(client, "The router reads", "main", max_tokens=3)[1]


def test_grammar_logprobs_logit_bias_and_penalties_over_grpc(daemon):
    """The sampling surface of the HTTP APIs over gRPC too (issue #34): a regex grammar holds, logprobs come back
    one per token with their alternatives, logit_bias steers, out-of-range values and broken grammars are
    INVALID_ARGUMENT."""
    import math
    import re

    with daemon.client() as client:
        if "main" not in {m.name for m in client.status().models}:
            load(client, "tiny", name="main", context_length=256)
        for seed in range(3):
            text, _, reason = collect(client, "The router reads", "main", max_tokens=40, temperature=1.0, seed=seed,
                                      grammar={"kind": "regex", "text": "(yes|no)[0-9]{3}"})
            assert re.fullmatch("(yes|no)[0-9]{3}", text) and reason == "eos", text
        parts = list(client.generate(prompt="The router reads", model="main", max_tokens=5, logprobs=3))
        ids = [t for p in parts for t in p.token_ids]
        logprobs = [lp for p in parts for lp in p.logprobs]
        assert [lp.token_id for lp in logprobs] == ids and len(ids) == 5
        for lp in logprobs:  # greedy: the chosen token is the most likely alternative
            assert len(lp.top_ids) == 3 and lp.top_ids[0] == lp.token_id
            assert math.isclose(lp.top_logprobs[0], lp.logprob, abs_tol=1e-5) and lp.logprob <= 0
        _, plain, _ = collect(client, "The router reads", "main", max_tokens=4)
        target = (plain[0] + 7) % 512
        _, biased, _ = collect(client, "The router reads", "main", max_tokens=4, logit_bias={target: 100.0})
        assert biased == [target] * 4
        _, penalised, _ = collect(client, "The router reads", "main", max_tokens=4, logit_bias={target: 100.0},
                                  frequency_penalty=2.0, presence_penalty=2.0)
        assert penalised[0] == target
        for bad in (dict(presence_penalty=3.0), dict(logprobs=99), dict(logit_bias={5: 500.0}),
                    dict(grammar={"kind": "regex", "text": "(unclosed"}), dict(grammar={"kind": "xml", "text": "a"})):
            with pytest.raises(DaemonCallError) as info:
                list(client.generate(prompt="hello", model="main", max_tokens=4, **bad))
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, (bad, info.value)


def test_unknown_model_to_load_and_bad_options(daemon):
    with daemon.client() as client:
        with pytest.raises(DaemonCallError) as info:
            load(client, "/nonexistent/model")
        assert "not found" in str(info.value)
        with pytest.raises(DaemonCallError) as info:
            load(client, "tiny", name="bad", policy="nonsense")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_garbage_bytes_and_vanishing_clients_do_not_hurt(daemon):
    for payload in (b"\x00" * 64, os.urandom(4096), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(256)):
        raw = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        raw.connect(str(daemon.socket))
        raw.sendall(payload)
        raw.close()
    with daemon.client() as client:
        if "main" not in {m.name for m in client.status().models}:
            load(client, "tiny", name="main")
        # a client that starts a long stream and disappears: its request is cancelled
        code = ("import sys; sys.path.insert(0, %r)\n"
                "from moed.api.client import MoedClient\n"
                "c = MoedClient(%r)\n"
                "s = c.generate(prompt='The router reads', model='main', max_tokens=500, ignore_eos=True)\n"
                "next(s); import os; os._exit(0)\n") % (str(daemon.home), str(daemon.socket))
        subprocess.run([sys.executable, "-c", code], timeout=60, check=True)
        deadline = time.monotonic() + 15
        while client.status().active_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.status().active_requests == 0
        assert collect(client, "The GPU", "main", max_tokens=3)[1]
        assert daemon.health() == SERVING


def test_vram_pressure_resizes_the_cache_without_changing_tokens(daemon):
    total, headroom = 8 << 30, 512 << 20
    with daemon.client() as client:
        load(client, "tiny", name="elastic", device="emulated", cache_fraction=1.0)
        expected = collect(client, "The scheduler finds", "elastic", max_tokens=48, ignore_eos=True)
        full = client.status().engine.cache_slots
        assert full > 0
        resizes = client.status().cache_resizes
        for _ in range(2):
            # another app grabs nearly all VRAM: the budget falls to ~half of this model's expert pool
            daemon.set_other_apps(total, total - headroom - 600_000)
            shrunk = wait_for(lambda: client.status().engine.cache_slots < full, 10)
            assert shrunk, "the cache did not shrink under pressure"
            assert collect(client, "The scheduler finds", "elastic", max_tokens=48, ignore_eos=True) == expected
            # ... and gives it back: the cache grows again after the hysteresis delay
            daemon.set_other_apps(total, 0)
            assert wait_for(lambda: client.status().engine.cache_slots == full, 15), "the cache did not grow back"
            assert collect(client, "The scheduler finds", "elastic", max_tokens=48, ignore_eos=True) == expected
        assert client.status().cache_resizes >= resizes + 4
        client.unload("elastic")


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_second_daemon_on_the_same_socket_says_where_the_first_listens(daemon, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moed.cli.main", "serve", "--socket", str(daemon.socket)],
                          env=daemon.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "already running" in proc.stderr and str(daemon.socket) in proc.stderr


def test_cli_client_commands(daemon):
    env = dict(daemon.env, MOED_SOCKET=str(daemon.socket))
    run = lambda *a: subprocess.run([sys.executable, "-m", "moed.cli.main", *a], env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    with daemon.client() as client:
        if "main" not in {m.name for m in client.status().models}:
            load(client, "tiny", name="main", context_length=256)
    ps = run("ps")
    assert ps.returncode == 0 and "main" in ps.stdout, ps.stderr
    header, *rows = ps.stdout.splitlines()
    assert "CONTEXT" in header and "UNTIL" in header
    assert rows and all(r.split()[4].isdigit() and r.rstrip().endswith("forever") for r in rows), ps.stdout
    models = run("models")
    assert models.returncode == 0, models.stderr
    rows = [r.split() for r in models.stdout.splitlines()[1:]]
    assert any(r[:2] == ["main", "moed"] and r[-2] in ("idle", "generating") for r in rows), models.stdout
    status = run("status")
    assert status.returncode == 0 and "state" in status.stdout
    answer = run("run", "--raw", "The router reads", "--max-tokens", "5", "--model", "main")
    assert answer.returncode == 0 and "generated 5 tok" in answer.stderr, answer.stderr
    cap = run("cap", "50%")
    assert cap.returncode == 0 and "VRAM cap" in cap.stdout, cap.stderr
    assert run("cap", "auto").returncode == 0


def test_clients_say_clearly_when_no_daemon_runs(tmp_path):
    with pytest.raises(DaemonUnavailableError) as info:
        MoedClient(str(tmp_path / "none.sock"), timeout=2).status()
    assert "moed serve" in str(info.value)
    proc = subprocess.run([sys.executable, "-m", "moed.cli.main", "status", "--socket", str(tmp_path / "none.sock")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no moed daemon" in proc.stderr


def test_non_loopback_bind_without_token_is_refused_and_token_is_enforced(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moed.cli.main", "serve", "--socket", str(tmp_path / "a.sock"),
                           "--tcp", "0.0.0.0:0"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, MOED_RUNTIME_DIR=str(tmp_path / "run"), MOED_LOG_DIR=str(tmp_path)))
    assert proc.returncode == 2 and "token" in proc.stderr
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = start_daemon(tmp_path / "tok", "--tcp", f"127.0.0.1:{port}", "--token", "s3cret")
    try:
        with pytest.raises(DaemonCallError) as info:
            MoedClient(f"127.0.0.1:{port}").status()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert MoedClient(f"127.0.0.1:{port}", token="s3cret").status().state == "idle"
    finally:
        assert d.stop() == 0


def test_socket_is_private_and_sigterm_stops_cleanly(tmp_path):
    d = start_daemon(tmp_path / "perm")
    assert (os.stat(d.socket).st_mode & 0o777) == 0o600
    assert d.stop() == 0
    assert not d.socket.exists()


def _wait_for(predicate, what: str, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the daemon exited with {proc.returncode} before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_sigterm_during_start_up_stops_cleanly(tmp_path):
    """`systemctl --user stop moed` right after a start: the handler is in place before anything
    the daemon creates (its log file is the first), so SIGTERM at any later point is an orderly stop."""
    d = start_daemon(tmp_path / "early", wait=False)
    log_file = d.home / "logs" / "moed.log"
    _wait_for(log_file.exists, "it created its log file", d.proc)
    assert d.stop() == 0, (d.home / "daemon.out").read_text()
    assert not d.socket.exists(), "a stop during start-up left the socket behind"
    assert "moed daemon stopped" in (d.home / "daemon.out").read_text()


def test_sigterm_as_soon_as_the_socket_appears_or_during_the_initial_load_stops_cleanly(tmp_path, models_dir):
    d = start_daemon(tmp_path / "sock", wait=False)
    _wait_for(d.socket.exists, "it created its socket", d.proc)
    assert d.stop() == 0, (d.home / "daemon.out").read_text()
    assert not d.socket.exists()
    d = start_daemon(tmp_path / "load", "--model", "tiny", models_dir=models_dir, wait=False)
    _wait_for(d.socket.exists, "it created its socket", d.proc)
    assert d.stop() == 0, (d.home / "daemon.out").read_text()


def test_health_says_serving_only_once_the_initial_model_is_loaded(tmp_path, models_dir):
    d = start_daemon(tmp_path / "ready", "--model", "tiny", models_dir=models_dir, wait=False)
    try:
        _wait_for(d.socket.exists, "it created its socket", d.proc)
        deadline = time.monotonic() + 60
        while True:
            try:
                status = d.health()
            except grpc.RpcError:  # bound but not started yet
                status = None
            if status == SERVING:
                break
            assert time.monotonic() < deadline, "never became SERVING"
            time.sleep(0.01)
        with d.client() as client:
            assert [m.name for m in client.list_models()] == ["tiny"], "SERVING before the initial load was done"
    finally:
        assert d.stop() == 0


def test_watch_status_streams_and_calibrate_measures(daemon):
    with daemon.client() as client:
        load(client, "tiny", name="calib", device="emulated", emulated_b_p=2e9)
        updates = []
        for status in client.watch_status(0.1):
            updates.append(status)
            if len(updates) == 3:
                break
        assert len(updates) == 3 and all(u.version for u in updates)
        reply = client.calibrate("calib", seconds=0.2)
        assert reply.b_p > 0 and reply.b_h > 0 and reply.device == "emulated"
        assert 0 < reply.q_ratio <= 1
        with pytest.raises(DaemonCallError) as info:
            client.calibrate("calib", seconds=120)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        client.unload("calib")
