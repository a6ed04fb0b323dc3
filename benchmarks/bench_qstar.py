"""Does q* = m * B_P / B_H pick the fastest split?  Measured, not modelled.

For each of the paper's six machines (docs/design.md, Reference) we set the emulated device's
B_P so that B_P / B_H on this machine equals that machine's ratio, then sweep every q from 0 to
m: q experts are really copied (memcpy from the host bank into device slots, paced to B_P,
competing for DRAM as DMA does) while the other m - q really run on the CPU (numba kernel),
concurrently. The miss-service time is the wall time until both branches finish. We compare the
time at q* with the best q, and with the linear model's prediction
T(q) = max(q S / B_P, (m - q) S / (B_H - B_P)).

The CPU branch gets one numba thread and the copy thread the other core, so the "DMA engine"
does not steal the CPU branch's core (on this 2-core machine).

    python benchmarks/bench_qstar.py [--m 16] [--dtype bf16] [--shape 2048x768] [--repeats 5]
        [--json out.json] [--plot docs/img/qstar.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.devices.emulated import EmulatedDevice
from moed.experts.cpu_pool import CpuWorkerPool
from moed.experts.expert_ffn import run_expert
from moed.experts.split_policy import q_split, q_star

MACHINES = (  # name, B_P, B_H in GB/s (the paper, via docs/design.md)
    ("RTX 4060 laptop", 11.8, 47.5),
    ("RTX 3090 server", 25.3, 56.7),
    ("RTX 4090 server", 25.1, 63.2),
    ("RTX 5090 server", 52.7, 77.3),
    ("RTX 5090 desktop", 49.0, 53.8),
    ("RTX PRO 6000 workstation", 51.5, 178.0),
)


def random_bank(hidden: int, inter: int, dtype: str, num_experts: int):
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(num_experts, hidden, 2 * inter, generator=gen) * 0.02
    down = torch.randn(num_experts, inter, hidden, generator=gen) * 0.02
    return build_expert_bank(gate_up, down, num_moe_layers=1, num_experts=num_experts, dtype=dtype,
                             activation=ExpertActivation())


class Sweep:
    def __init__(self, bank, m: int, cpu_threads: int) -> None:
        self.bank, self.m = bank, m
        self.device = EmulatedDevice(b_p=1e12, b_dev=1e15)
        layout = {n: (tuple(t.shape[1:]), t.dtype) for n, t in bank.tensors.items()}
        self.slots = self.device.alloc_slots(m, layout)
        self.pool = CpuWorkerPool(cpu_threads)
        self.x = torch.randn(1, bank.hidden_size)
        self.cursor = 0

    def next_ids(self) -> list[int]:
        # rotate through the bank so each step touches experts the caches have not seen lately
        ids = [(self.cursor + i) % self.bank.num_slots for i in range(self.m)]
        self.cursor = (self.cursor + self.m) % self.bank.num_slots
        return ids

    def cpu_branch(self, ids: list[int]) -> float:
        for flat_id in ids:
            run_expert(self.bank, flat_id, self.x)
        return time.perf_counter()

    def step(self, q: int, detail: bool = False):
        ids = self.next_ids()
        fills, cpu = ids[:q], ids[q:]
        start = time.perf_counter()
        job = self.pool.submit(lambda: self.cpu_branch(cpu)) if cpu else None  # CPU branch first
        copy_end = start
        if fills:
            self.device.copy_rows_async(self.slots, list(range(q)), self.bank.tensors, fills).wait()
            copy_end = time.perf_counter()
        cpu_end = job.result() if job else start
        if detail:  # each branch's own bandwidth while the other ran
            size = self.bank.bytes_per_expert()
            return q * size / (copy_end - start), (self.m - q) * size / (cpu_end - start)
        return max(copy_end, cpu_end) - start

    def concurrent_bandwidths(self, repeats: int) -> tuple[float, float]:
        """B_P and B_H measured with both branches running at once (half the misses each)."""
        samples = [self.step(self.m // 2, detail=True) for _ in range(repeats)]
        return statistics.median(p for p, _ in samples), statistics.median(h for _, h in samples)

    def set_b_p(self, b_p: float) -> None:
        self.device.set_link_bandwidth(b_p)

    def measure_b_h(self, repeats: int) -> float:
        times = [self.step(0) for _ in range(repeats)]
        return self.m * self.bank.bytes_per_expert() / statistics.median(times)

    def measure_b_p(self, b_p: float, repeats: int) -> float:
        self.set_b_p(b_p)
        times = [self.step(self.m) for _ in range(repeats)]
        return self.m * self.bank.bytes_per_expert() / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=16, help="misses per step")
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "int4", "q8", "mxfp4"))
    parser.add_argument("--shape", default="2048x768", help="expert shape DxI (default Qwen3-30B-A3B)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-threads", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    hidden, inter = (int(v) for v in args.shape.split("x"))
    bank = random_bank(hidden, inter, args.dtype, num_experts=4 * args.m)
    size = bank.bytes_per_expert()
    sweep = Sweep(bank, args.m, args.cpu_threads)
    sweep.step(0)  # compile
    b_h = sweep.measure_b_h(args.repeats)
    unthrottled = sweep.measure_b_p(1e12, args.repeats)
    print(f"expert {args.shape} {args.dtype}: {size / 1e6:.2f} MB; m = {args.m}; "
          f"B_H (CPU branch alone, {args.cpu_threads} thread) = {b_h / 1e9:.2f} GB/s; "
          f"unthrottled copy = {unthrottled / 1e9:.2f} GB/s")
    rows = []
    for name, paper_bp, paper_bh in MACHINES:
        ratio = paper_bp / paper_bh
        b_p = ratio * b_h
        achieved = sweep.measure_b_p(b_p, args.repeats)
        times = []
        for q in range(args.m + 1):
            sweep.set_b_p(b_p)
            times.append(statistics.median(sweep.step(q) for _ in range(args.repeats)))
        qs = q_star(args.m, b_p, b_h)
        b_p_c, b_h_c = sweep.concurrent_bandwidths(args.repeats)
        qc = q_split(args.m, b_p_c, b_h_c)
        best = min(range(args.m + 1), key=lambda q: times[q])
        model = [max(q * size / b_p, (args.m - q) * size / max(b_h - b_p, 1e-9)) for q in range(args.m + 1)]
        rows.append(dict(machine=name, ratio=ratio, b_p=b_p, b_p_achieved=achieved, b_h=b_h, q_star=qs,
                         best_q=best, t_q_star=times[qs], t_best=times[best],
                         gap=times[qs] / times[best] - 1, times=times, model=model,
                         b_p_concurrent=b_p_c, b_h_concurrent=b_h_c, q_concurrent=qc, t_q_concurrent=times[qc],
                         gap_concurrent=times[qc] / times[best] - 1))
        print(f"{name:26s} B_P/B_H {ratio:.2f}: q* = {qs:2d}, q(concurrent) = {qc:2d}, best q = {best:2d}, "
              f"T(q*) = {times[qs] * 1e3:6.1f} ms, T(qc) = {times[qc] * 1e3:6.1f} ms, "
              f"T(best) = {times[best] * 1e3:6.1f} ms", flush=True)
    print()
    print("| machine | B_P/B_H | B_P set (achieved) GB/s | best q | q* | T(q*) vs best | B_P,c / B_H,c GB/s | q from concurrent | T vs best | T(0) ms | T(best) ms | T(m) ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['machine']} | {r['ratio']:.2f} | {r['b_p'] / 1e9:.1f} ({r['b_p_achieved'] / 1e9:.1f}) | "
              f"{r['best_q']} | {r['q_star']} | +{r['gap']:.1%} | "
              f"{r['b_p_concurrent'] / 1e9:.1f} / {r['b_h_concurrent'] / 1e9:.1f} | {r['q_concurrent']} | "
              f"+{r['gap_concurrent']:.1%} | {r['times'][0] * 1e3:.1f} | {r['t_best'] * 1e3:.1f} | "
              f"{r['times'][-1] * 1e3:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(m=args.m, dtype=args.dtype, shape=args.shape, bytes_per_expert=size, b_h=b_h,
                           unthrottled_copy=unthrottled, rows=rows), fh, indent=2)
    if args.plot:
        plot(rows, args, args.plot)
    sweep.pool.close()
    return 0


def plot(rows, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharex=True)
    qs = list(range(args.m + 1))
    for ax, r in zip(axes.flat, rows):
        ax.plot(qs, [t * 1e3 for t in r["times"]], "o-", label="measured")
        ax.plot(qs, [t * 1e3 for t in r["model"]], "--", color="gray", label="linear model")
        ax.axvline(r["q_star"], color="red", label=f"q* = {r['q_star']}")
        ax.axvline(r["q_concurrent"], color="orange", linestyle="-.", label=f"q from concurrent B = {r['q_concurrent']}")
        ax.axvline(r["best_q"], color="green", linestyle=":", label=f"best q = {r['best_q']}")
        ax.set_title(f"{r['machine']} (B_P/B_H = {r['ratio']:.2f})", fontsize=9)
        ax.set_ylim(0, max(max(r["times"]), max(r["model"])) * 1e3 * 1.1)
        ax.legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel(f"q (experts copied, of m = {args.m})")
    for ax in axes[:, 0]:
        ax.set_ylabel("miss-service time (ms)")
    fig.suptitle(f"q* vs measured: {args.shape} {args.dtype} experts, emulated device on this machine")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
