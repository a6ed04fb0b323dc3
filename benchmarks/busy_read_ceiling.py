"""How much of its quiet speed can bandwidth-bound work keep when another program keeps a core busy?

    .venv/bin/python benchmarks/busy_read_ceiling.py [--seconds 8] [--rounds 3] [--mb 512]

The ceiling behind issue #12's "busy core" row. The purest bandwidth-bound workload, a read over a
buffer much larger than the caches, cut into 1 MiB tasks taken from one atomic counter (as moed's
pool does; a thread that loses its core simply takes fewer tasks), with 1 and 2 threads; each
measured quiet and with `python3 -c "while True: pass"` running (started before, killed after),
alternating, `--rounds` times. Prints GB/s and busy/quiet per thread count.

When one thread cannot read at two threads' bandwidth (on the 2-core build VM: ~35 against ~48
GB/s), losing a core costs a read loop a fixed share however it is scheduled: with 3 runnable
threads on 2 cores a fair scheduler gives each of ours 2/3 of a core, so both run together a
third of the time, roughly (1/3) + (2/3) * (one thread / two threads) of the quiet speed. A decode
that streams its weights at the machine's bandwidth cannot keep more than this loop does.

The program is plain C (pthreads, no intrinsics), compiled here with the system `cc`. Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static uint64_t *buf;
static size_t words, chunk_words, ntasks;
static atomic_size_t next_task;
static atomic_uint_fast64_t sink;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *reader(void *arg) {
    (void)arg;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (;;) {
        size_t t = atomic_fetch_add(&next_task, 1);
        if (t >= ntasks) break;
        const uint64_t *p = buf + t * chunk_words;
        for (size_t i = 0; i < chunk_words; i += 4) {
            s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3];
        }
    }
    atomic_fetch_add(&sink, s0 + s1 + s2 + s3);
    return NULL;
}

/* one pass over the buffer with n threads (the caller is one of them): GB/s */
static double pass(int n) {
    pthread_t th[8];
    atomic_store(&next_task, 0);
    double t0 = now();
    for (int i = 1; i < n; i++) pthread_create(&th[i], NULL, reader, NULL);
    reader(NULL);
    for (int i = 1; i < n; i++) pthread_join(th[i], NULL);
    return words * 8.0 / (now() - t0) / 1e9;
}

int main(int argc, char **argv) {
    size_t mb = (size_t)atol(argv[1]);
    double seconds = atof(argv[2]);
    words = mb * (1u << 20) / 8;
    chunk_words = (1u << 20) / 8;
    ntasks = words / chunk_words;
    buf = aligned_alloc(1 << 21, words * 8);
    if (!buf) return 1;
    madvise(buf, words * 8, MADV_HUGEPAGE);
    memset(buf, 1, words * 8);
    double sum[3] = {0}, end = now() + seconds;
    int count[3] = {0};
    while (now() < end)
        for (int n = 1; n <= 2; n++) { sum[n] += pass(n); count[n]++; }
    printf("%.2f %.2f\n", sum[1] / count[1], sum[2] / count[2]);
    return 0;
}
"""


def build(workdir: Path) -> Path:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        sys.exit("busy_read_ceiling: no C compiler (cc, gcc or clang) on PATH")
    src, exe = workdir / "read_ceiling.c", workdir / "read_ceiling"
    src.write_text(SOURCE)
    subprocess.run([cc, "-O3", "-std=c11", "-pthread", str(src), "-o", str(exe)], check=True)
    return exe


def measure(exe: Path, mb: int, seconds: float, busy: bool) -> tuple[float, float]:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if hog:
            time.sleep(0.5)  # let it take its core
        out = subprocess.run([str(exe), str(mb), str(seconds)], check=True, capture_output=True, text=True)
    finally:
        if hog:
            hog.kill()
            hog.wait()
    one, two = (float(v) for v in out.stdout.split())
    return one, two


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="quiet/busy pairs")
    ap.add_argument("--mb", type=int, default=512, help="buffer size in MiB (>> last-level cache)")
    args = ap.parse_args()
    if args.seconds <= 0 or args.rounds < 1 or args.mb < 64:
        sys.exit("busy_read_ceiling: --seconds > 0, --rounds >= 1 and --mb >= 64 please")
    with tempfile.TemporaryDirectory(prefix="moed-read-ceiling-") as tmp:
        exe = build(Path(tmp))
        print(f"read over {args.mb} MiB in 1 MiB tasks, {os.cpu_count()} CPUs, {args.seconds:g} s per measurement\n")
        print("| round | 1 thread quiet | busy | 2 threads quiet | busy | busy/quiet (2 threads) | 1 thread / 2 threads quiet | fair-share estimate |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in range(args.rounds):
            q1, q2 = measure(exe, args.mb, args.seconds, busy=False)
            b1, b2 = measure(exe, args.mb, args.seconds, busy=True)
            ratio = q1 / q2
            print(f"| {r + 1} | {q1:.1f} | {b1:.1f} | {q2:.1f} | {b2:.1f} | {b2 / q2:.2f} | {ratio:.2f} | "
                  f"{1 / 3 + 2 / 3 * ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
