"""Peak RSS of `moed convert` (and of loading the result) on real-size synthetic Qwen3-MoE checkpoints.

    .venv/bin/python benchmarks/bench_convert_memory.py --layers 6 12 --workdir /tmp/convbench \
        [--experts-dtype int4] [--keep] [--rss-limit-gib 20] [--json results.json]

For each layer count: writes a random Qwen3-30B-A3B-shaped Hugging Face checkpoint (hidden 2048,
128 experts x 768, top-8, 32 q / 4 kv heads x 128, vocab 49152; bf16, one safetensors shard per
layer; 6 layers = ~7.9 GB, 12 layers = ~15.6 GB) with tests/helpers/synthetic_checkpoint.py, runs

    /usr/bin/time -v .venv/bin/moed convert SRC DST --experts-dtype int4
    /usr/bin/time -v .venv/bin/moed generate --model DST --prompt hi --max-tokens 16

and prints a markdown table of source / FTW size, peak RSS and wall time of both. A streaming
converter peaks at about the same RSS for 6 and 12 layers; the "convert RSS growth" line gives the
growth per extra layer. Without /usr/bin/time (Debian package `time`) the peak is the child's
ru_maxrss from wait4.

One layer count at a time: its source and output are deleted before the next is written (unless
--keep), so the disk needs room for the largest source + output (checked first). The children
are killed when their RSS passes --rss-limit-gib (default 90% of MemAvailable at start) so a
non-streaming converter cannot take the machine down; such a row says "killed".

Hidden flags (--hidden, --experts, --inter, --vocab, --top-k, --heads, --kv-heads, --head-dim)
shrink the model, for a quick end-to-end check of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WRITER = REPO / "tests" / "helpers" / "synthetic_checkpoint.py"
GIB = 1 << 30


def _default_exe(name: str) -> str | None:
    venv = REPO / ".venv" / "bin" / name
    if venv.is_file():
        return str(venv)
    return shutil.which(name)


def source_bytes(layers: int, s: argparse.Namespace) -> int:
    """bf16 bytes of the synthetic checkpoint (headers and tokenizer excluded)."""
    d, e, i, v = s.hidden, s.experts, s.inter, s.vocab
    attn = d * s.heads * s.head_dim * 2 + d * s.kv_heads * s.head_dim * 2 + 2 * s.head_dim
    per_layer = attn + 2 * d + e * d + e * 3 * d * i
    return 2 * (layers * per_layer + 2 * v * d + d)


def expert_source_bytes(layers: int, s: argparse.Namespace) -> int:
    return 2 * layers * s.experts * 3 * s.hidden * s.inter


def ftw_estimate(layers: int, s: argparse.Namespace) -> int:
    """Rough FTW size: non-expert weights as float32, experts in the chosen format."""
    experts = expert_source_bytes(layers, s)
    rest = source_bytes(layers, s) - experts
    per_bf16_byte = {"fp32": 2.0, "bf16": 1.0, "int4": (0.5 + 4 / 32) / 2, "q8": (1 + 2 / 32) / 2,
                     "mxfp4": (0.5 + 1 / 32) / 2}[s.experts_dtype]
    return int(2 * rest + per_bf16_byte * experts)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return psutil.virtual_memory().available


class Watch:
    """Polls a process tree's RSS; kills the whole group (started with its own session) above a limit."""

    def __init__(self, proc: subprocess.Popen, limit: int) -> None:
        self.proc, self.limit = proc, limit
        self.peak = 0
        self.killed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree_rss(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                if p.name() == "time":
                    continue  # /usr/bin/time itself: ~2 MB, not the measured program
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        # never proc.poll() here: it could reap the child before run_measured's wait4 gets its rusage
        while not self._stop.is_set():
            rss = self._tree_rss()
            self.peak = max(self.peak, rss)
            if rss > self.limit and not self.killed:
                self.killed = True
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the group of the child we started
                except ProcessLookupError:
                    pass
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


USE_TIME = os.access("/usr/bin/time", os.X_OK)


def run_measured(cmd: list[str], log: Path, rss_limit: int, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd``; returns rc, wall_s, peak_rss (bytes; /usr/bin/time -v's or wait4's), sampled peak, killed."""
    use_time = USE_TIME
    full = ["/usr/bin/time", "-v", *cmd] if use_time else cmd
    print("$ " + " ".join(full), flush=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(full, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        watch = Watch(proc, rss_limit)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            watch.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    text = log.read_text(errors="replace")
    peak = None
    if use_time:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        peak = int(m.group(1)) * 1024 if m else None
    if peak is None:  # no /usr/bin/time (or it was killed): the child's own rusage
        peak = usage.ru_maxrss * 1024  # KiB on Linux
    return {"rc": proc.returncode, "wall_s": wall, "peak_rss": peak, "sampled_peak": watch.peak,
            "killed": watch.killed, "log": str(log), "tail": text[-2000:]}


def df(path: Path) -> None:
    if shutil.which("df"):
        subprocess.run(["df", "-h", str(path)], check=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="peak RSS of `moed convert` on real-size synthetic checkpoints",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--layers", type=int, nargs="+", default=[6, 12], help="layer counts (default 6 12)")
    p.add_argument("--workdir", type=Path, required=True, help="where checkpoints and outputs are written")
    p.add_argument("--experts-dtype", choices=("fp32", "bf16", "int4", "q8", "mxfp4"), default="int4")
    p.add_argument("--keep", action="store_true", help="keep the sources and outputs (needs room for all)")
    p.add_argument("--rss-limit-gib", type=float, help="kill a child above this RSS (default 90%% of MemAvailable)")
    p.add_argument("--moed", default=_default_exe("moed"), help="the moed executable (default .venv/bin/moed)")
    p.add_argument("--python", default=_default_exe("python") or sys.executable,
                   help="python with torch+transformers for the checkpoint writer (default .venv/bin/python)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-generate", action="store_true", help="measure the conversion only")
    p.add_argument("--json", type=Path, help="also write the results here")
    # model shape; hidden: for a quick end-to-end check of the script with a tiny model
    for flag, default in (("--hidden", 2048), ("--experts", 128), ("--inter", 768), ("--vocab", 49152),
                          ("--top-k", 8), ("--heads", 32), ("--kv-heads", 4), ("--head-dim", 128)):
        p.add_argument(flag, type=int, default=default, help=argparse.SUPPRESS)
    p.add_argument("--no-time-v", action="store_true", help=argparse.SUPPRESS)  # test the wait4 fallback
    args = p.parse_args(argv)
    global USE_TIME
    USE_TIME = USE_TIME and not args.no_time_v
    if not args.moed:
        p.error("no moed executable found; pass --moed PATH")
    layers = sorted(set(args.layers))
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)

    # disk: the largest source + output at once, or all of them with --keep
    needs = [source_bytes(n, args) + ftw_estimate(n, args) for n in layers]
    need = int((sum(needs) if args.keep else max(needs)) * 1.1) + (256 << 20)
    free = shutil.disk_usage(work).free
    df(work)
    print(f"disk: need ~{need / 1e9:.1f} GB in {work}, {free / 1e9:.1f} GB free", flush=True)
    if free < need:
        print(f"error: not enough free disk in {work}: need ~{need / 1e9:.1f} GB, have {free / 1e9:.1f} GB",
              file=sys.stderr)
        return 2
    available = mem_available()
    rss_limit = int(args.rss_limit_gib * GIB) if args.rss_limit_gib else int(0.9 * available)
    print(f"memory: {available / GIB:.1f} GiB available; children are killed above {rss_limit / GIB:.1f} GiB",
          flush=True)

    shape = ["--hidden", args.hidden, "--experts", args.experts, "--inter", args.inter, "--vocab", args.vocab,
             "--top-k", args.top_k, "--heads", args.heads, "--kv-heads", args.kv_heads, "--head-dim", args.head_dim]
    rows = []
    made: list[Path] = []
    try:
        for n in layers:
            src, dst = work / f"hf-{n}l", work / f"ftw-{n}l-{args.experts_dtype}"
            for path in (src, dst):
                if path.exists():
                    shutil.rmtree(path)
            made += [src, dst]
            print(f"\n== {n} layers: writing {src} (~{source_bytes(n, args) / 1e9:.2f} GB)", flush=True)
            started = time.perf_counter()
            subprocess.run([args.python, str(WRITER), str(src), "--layers", str(n), *map(str, shape)], check=True)
            print(f"written in {time.perf_counter() - started:.1f} s", flush=True)
            row = {"layers": n, "source_bytes": dir_bytes(src)}
            conv = run_measured([args.moed, "convert", str(src), str(dst), "--experts-dtype", args.experts_dtype],
                                logs / f"convert-{n}l.log", rss_limit)
            row["convert"] = conv
            ok = conv["rc"] == 0 and dst.is_dir()
            row["ftw_bytes"] = dir_bytes(dst) if ok else None
            if not ok:
                why = "killed at the RSS limit" if conv["killed"] else f"rc {conv['rc']}"
                print(f"convert failed ({why}); log {conv['log']}:\n{conv['tail']}", file=sys.stderr, flush=True)
            elif not args.no_generate:
                row["generate"] = run_measured(
                    [args.moed, "generate", "--model", str(dst), "--prompt", "hi", "--max-tokens", str(args.max_tokens)],
                    logs / f"generate-{n}l.log", rss_limit)
                if row["generate"]["rc"] != 0:
                    print(f"generate failed; log {row['generate']['log']}:\n{row['generate']['tail']}",
                          file=sys.stderr, flush=True)
            rows.append(row)
            if not args.keep:
                for path in (src, dst):
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        if not args.keep:
            for path in made:
                shutil.rmtree(path, ignore_errors=True)

    def cell(run: dict | None, key: str, scale: float, fmt: str) -> str:
        if run is None:
            return "-"
        if run["killed"]:
            return f"killed > {rss_limit / GIB:.2f}" if key == "peak_rss" else "-"
        if run["rc"] != 0:
            return f"rc {run['rc']}"
        return format(run[key] / scale, fmt)

    print(f"\nexperts {args.experts_dtype}; model: hidden {args.hidden}, {args.experts} experts x {args.inter}, "
          f"top-{args.top_k}, {args.heads}/{args.kv_heads} heads x {args.head_dim}, vocab {args.vocab}; "
          f"peak RSS from {'/usr/bin/time -v' if USE_TIME else 'wait4 ru_maxrss'}\n")
    print("| layers | source GB | FTW GB | convert peak RSS GiB | convert wall s | generate peak RSS GiB | generate wall s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ftw = f"{r['ftw_bytes'] / 1e9:.2f}" if r.get("ftw_bytes") else "-"
        gen = r.get("generate")
        print(f"| {r['layers']} | {r['source_bytes'] / 1e9:.2f} | {ftw} | {cell(r['convert'], 'peak_rss', GIB, '.2f')} | "
              f"{cell(r['convert'], 'wall_s', 1, '.1f')} | {cell(gen, 'peak_rss', GIB, '.2f')} | "
              f"{cell(gen, 'wall_s', 1, '.1f')} |")
    good = [r for r in rows if r["convert"]["rc"] == 0]
    if len(good) >= 2:
        a, b = good[0], good[-1]
        growth = b["convert"]["peak_rss"] - a["convert"]["peak_rss"]
        extra = b["source_bytes"] - a["source_bytes"]
        print(f"\nconvert RSS growth {a['layers']} -> {b['layers']} layers: {growth / 2**20:+.0f} MiB "
              f"({growth / 2**20 / (b['layers'] - a['layers']):+.1f} MiB per layer, "
              f"{growth / extra:.2f}x the {extra / 1e9:.2f} GB of extra source)")
    print(f"logs: {logs}" + ("" if args.keep else "; sources and outputs deleted"))
    if args.json:
        args.json.write_text(json.dumps({"experts_dtype": args.experts_dtype, "rss_limit": rss_limit,
                                         "shape": dict(zip(shape[::2], shape[1::2])), "rows": rows}, indent=2))
    return 0 if len(good) == len(rows) and all(r.get("generate", {"rc": 0})["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
