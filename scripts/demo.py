"""The demo's end-to-end run: ask the demo model in chat mode and check the answer names Paris."""

from __future__ import annotations

import argparse
import subprocess
import sys

QUESTION = "What is the capital of France?"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "moed.cli.main", "generate", "--model", args.model, "--chat",
           "--prompt", QUESTION, "--max-tokens", "40"]
    print("$ moed generate --model", args.model, "--chat --prompt", repr(QUESTION), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        return proc.returncode
    if "Paris" not in proc.stdout:
        print("demo FAILED: the answer does not mention Paris", file=sys.stderr)
        return 1
    print("demo OK: the answer mentions Paris")
    return 0


if __name__ == "__main__":
    sys.exit(main())
