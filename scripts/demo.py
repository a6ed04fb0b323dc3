"""`make demo`: the real product end to end: start the daemon, load the demo model over gRPC, ask it
through the CLI client, print `moed ps`, stop the daemon. Fails unless the answer names Paris.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "What is the capital of France?"


def moed(*args: str, socket: str, capture: bool = False) -> subprocess.CompletedProcess:
    print(f"$ moed {' '.join(args)}", flush=True)
    return subprocess.run([sys.executable, "-m", "moed.cli.main", *args, "--socket", socket],
                          stdout=subprocess.PIPE if capture else None, text=True)


def wait_for_daemon(socket: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    from moed.api.client import MoedClient, MoedError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"demo FAILED: the daemon exited with status {proc.returncode}")
        if Path(socket).exists():
            try:
                with MoedClient(socket, timeout=2) as client:
                    client.status()
                return
            except MoedError:
                pass
        time.sleep(0.1)
    raise SystemExit("demo FAILED: the daemon did not come up")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="auto", help="cpu, emulated, cuda or auto")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="moed-demo-"))
    socket = str(run_dir / "moed.sock")
    env = dict(os.environ, MOED_RUNTIME_DIR=str(run_dir), MOED_LOG_DIR=str(run_dir / "logs"))
    print(f"$ moed serve --socket {socket} &", flush=True)
    daemon = subprocess.Popen([sys.executable, "-m", "moed.cli.main", "serve", "--socket", socket], env=env)
    try:
        wait_for_daemon(socket, daemon)
        if moed("load", args.model, "--name", "demo", "--device", args.device, socket=socket).returncode:
            return 1
        answer = moed("run", QUESTION, "--max-tokens", "40", socket=socket, capture=True)
        sys.stdout.write(answer.stdout)
        if moed("ps", socket=socket).returncode or moed("status", socket=socket).returncode:
            return 1
        ok = answer.returncode == 0 and "Paris" in answer.stdout
    finally:
        moed("stop", socket=socket)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
    print("demo OK: the daemon answered and the answer mentions Paris" if ok
          else "demo FAILED: the answer does not mention Paris")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
