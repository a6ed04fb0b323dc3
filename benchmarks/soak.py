"""Soak test: N concurrent streaming clients against a real daemon for M minutes (bounded).

    python benchmarks/soak.py --model models/demo-moe-ftw [--streams 8] [--minutes 2] [--device cpu]
        [--max-tokens 48]

Starts its own daemon on a temporary socket (loopback only), loads the model, runs the streams
(each a loop of chat requests with random lengths, some cancelled mid-stream, some with invalid
parameters on purpose), then reports requests served, errors by kind, tokens/s and the daemon's
RSS growth between the end of warm-up and the end. Stops by itself.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

from moed.api.client import DaemonCallError, MoedClient, MoedError

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Count from one to ten.",
             "Write a haiku about the sea.", "What is 12 times 12?", "Explain what a cache is."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/demo-moe-ftw")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    if not (1 <= args.streams <= 64 and 0 < args.minutes <= 60):
        raise SystemExit("--streams must be 1..64 and --minutes in (0, 60]")
    run_dir = Path(tempfile.mkdtemp(prefix="moed-soak-"))
    socket = str(run_dir / "moed.sock")
    env = dict(os.environ, MOED_RUNTIME_DIR=str(run_dir), MOED_LOG_DIR=str(run_dir / "logs"))
    daemon = subprocess.Popen([sys.executable, "-m", "moed.cli.main", "serve", "--socket", socket,
                               "--max-queue", "256"], env=env, stdout=subprocess.DEVNULL)
    try:
        client = MoedClient(socket, timeout=5)
        client.wait_ready(60)
        for _ in client.load(args.model, name="soak", device=args.device, max_batch=8):
            pass
        proc = psutil.Process(daemon.pid)
        counts: collections.Counter = collections.Counter()
        tokens = [0]
        lock = threading.Lock()
        end = time.monotonic() + args.minutes * 60
        warm_rss: list[int] = []

        def stream(seed: int) -> None:
            rng = random.Random(seed)
            with MoedClient(socket, timeout=5) as own:
                while time.monotonic() < end:
                    kind = rng.random()
                    try:
                        if kind < 0.05:  # invalid on purpose: must be refused, never crash the daemon
                            list(own.generate(prompt="x", model="soak", temperature=-1.0))
                        stream_iter = own.generate(messages=[{"role": "user", "content": rng.choice(QUESTIONS)}],
                                                   model="soak", max_tokens=rng.randint(4, args.max_tokens),
                                                   temperature=rng.choice([0.0, 0.7]), seed=rng.randint(0, 99),
                                                   request_id=f"soak-{seed}-{rng.random()}")
                        got = 0
                        for part in stream_iter:
                            got += len(part.token_ids)
                            if kind > 0.9 and got >= 3:  # walk away mid-stream
                                stream_iter.cancel() if hasattr(stream_iter, "cancel") else None
                                break
                        with lock:
                            counts["served"] += 1
                            tokens[0] += got
                    except DaemonCallError as exc:
                        with lock:
                            counts[f"refused {exc.code.name}"] += 1
                    except (MoedError, grpc.RpcError) as exc:
                        with lock:
                            counts[f"error {type(exc).__name__}"] += 1

        started = time.monotonic()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(args.streams)]
        for t in threads:
            t.start()
        time.sleep(min(20.0, args.minutes * 60 / 4))
        warm_rss.append(proc.memory_info().rss)
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        final_rss = proc.memory_info().rss
        status = client.status()
        print(f"streams {args.streams}, {elapsed / 60:.1f} min, model {args.model} on {status.engine.device or 'cpu'}")
        print(f"requests served {counts['served']}, tokens {tokens[0]} ({tokens[0] / elapsed:.1f} tok/s overall)")
        others = {k: v for k, v in counts.items() if k != "served"}
        print(f"refused/errors: {others or 'none'} (about 5% of requests are invalid on purpose)")
        print(f"daemon RSS after warm-up {warm_rss[0] / 2**20:.0f} MiB, at end {final_rss / 2**20:.0f} MiB, "
              f"growth {(final_rss - warm_rss[0]) / 2**20:+.0f} MiB")
        print(f"daemon still healthy: state {status.state}, served {status.requests_served}, "
              f"active {status.active_requests}")
        client.shutdown()
        client.close()
        daemon.wait(60)
        print(f"daemon exit status {daemon.returncode}")
        return 0 if daemon.returncode == 0 and not any(k.startswith("error") for k in counts) else 1
    finally:
        if daemon.poll() is None:
            daemon.kill()


if __name__ == "__main__":
    sys.exit(main())
