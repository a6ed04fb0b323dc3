"""Start a real `moed serve` process on a temporary socket for tests, and stop it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moed.api.client import MoedClient


@dataclass
class Daemon:
    proc: subprocess.Popen
    socket: Path
    env: dict
    home: Path
    gpu_file: Path

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    def client(self, **kw) -> MoedClient:
        return MoedClient(str(self.socket), **kw)

    def health(self, service: str = "") -> int:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def set_other_apps(self, total: int, other_apps: int) -> None:
        tmp = self.gpu_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"total": total, "other_apps": other_apps}))
        tmp.replace(self.gpu_file)  # atomic: the daemon never reads half a file

    def kill(self) -> int:
        """SIGKILL: no handler runs and nothing is cleaned up, as in a crash or an OOM kill."""
        self.proc.kill()
        return self.proc.wait(30)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(home: Path, *args: str, models_dir: Path | None = None, gpu_total: int = 8 << 30,
                 wait: bool = True, extra_env: dict[str, str] | None = None) -> Daemon:
    home.mkdir(parents=True, exist_ok=True)
    socket = home / "moed.sock"
    gpu_file = home / "gpu.json"
    gpu_file.write_text(json.dumps({"total": gpu_total, "other_apps": 0}))
    env = dict(os.environ, MOED_RUNTIME_DIR=str(home / "run"), MOED_LOG_DIR=str(home / "logs"),
               MOED_CACHE_DIR=str(home / "cache"), MOED_MODELS=str(models_dir or home / "models"),
               MOED_GPU_MEMORY_FILE=str(gpu_file), PYTHONUNBUFFERED="1",
               # the other model stores are this home's (empty unless a test fills them), never the user's
               OLLAMA_MODELS=str(home / "ollama"), HF_HUB_CACHE=str(home / "hf"), LMSTUDIO_MODELS=str(home / "lmstudio"),
               **(extra_env or {}))
    env.pop("MOED_SOCKET", None)
    log = open(home / "daemon.out", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "moed.cli.main", "serve", "--socket", str(socket), *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    daemon = Daemon(proc, socket, env, home, gpu_file)
    if wait:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}: {(home / 'daemon.out').read_text()}")
            if socket.exists():
                try:
                    daemon.health()
                    return daemon
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        daemon.stop()
        raise RuntimeError(f"daemon did not come up: {(home / 'daemon.out').read_text()}")
    return daemon
