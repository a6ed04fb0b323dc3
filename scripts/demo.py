"""`make demo`: the real product end to end: start the daemon (gRPC + HTTP), list the models it finds, ask the
demo model by name through the CLI (the daemon loads it on demand), print `moed ps`, ask it again through
Ollama's API with the official `ollama` client, stop the daemon. Fails unless both answers name Paris.
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


def ask_over_ollamas_api(socket: str, name: str) -> bool:
    """The same question through Ollama's API, as Ollama's apps ask it (the official client, streamed)."""
    import ollama

    from moed.api.client import MoedClient

    with MoedClient(socket, timeout=10) as client:
        url = client.status().http_url
    print(f">>> ollama.Client(host={url!r}).chat(model={name!r}, stream=True)", flush=True)
    parts = ollama.Client(host=url, timeout=300).chat(
        model=name, messages=[{"role": "user", "content": QUESTION}], stream=True,
        options={"num_predict": 40, "temperature": 0})
    text = "".join(part.message.content for part in parts)
    print(text, flush=True)
    return "Paris" in text


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="auto", help="cpu, emulated, cuda or auto")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="moed-demo-"))
    socket = str(run_dir / "moed.sock")
    model = Path(args.model).resolve()
    env = dict(os.environ, MOED_RUNTIME_DIR=str(run_dir), MOED_LOG_DIR=str(run_dir / "logs"),
               MOED_MODELS=str(model.parent))
    serve = ["serve", "--socket", socket, "--http", "127.0.0.1:0", "--device", args.device]
    print(f"$ MOED_MODELS={model.parent} moed {' '.join(serve)} &", flush=True)
    daemon = subprocess.Popen([sys.executable, "-m", "moed.cli.main", *serve], env=env)
    try:
        wait_for_daemon(socket, daemon)
        if moed("models", socket=socket).returncode:
            return 1
        answer = moed("run", model.name, QUESTION, "--max-tokens", "40", socket=socket, capture=True)
        sys.stdout.write(answer.stdout)
        if moed("ps", socket=socket).returncode or moed("status", socket=socket).returncode:
            return 1
        ok = answer.returncode == 0 and "Paris" in answer.stdout
        ok = ask_over_ollamas_api(socket, model.name) and ok
    finally:
        moed("stop", socket=socket)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
    print("demo OK: the daemon answered over gRPC and Ollama's API, and both answers mention Paris" if ok
          else "demo FAILED: an answer does not mention Paris")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
