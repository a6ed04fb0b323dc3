"""Double-buffered prefill on the emulated device: time against max(pool transfer, compute), with and without.

    python benchmarks/bench_prefill_stream.py [--layers 8] [--experts 32] [--hidden 512] [--inter 512]
        [--top-k 4] [--bp 0.25] [--tflops 0.125] [--tokens 1024,4096,8192]

One prefill step of T tokens through every MoE layer of a bf16 bank, on the executor the engine
uses, with the emulated device in its timing mode: copies are real memcpys paced to B_P by the
copy thread, device compute is the timing model (max(bytes / b_dev, FLOPs / flops)) slept on the
calling thread with no arithmetic done (``timing_only``), so the wall time is the schedule the
executor's code produces: what overlaps and what waits. The defaults make one layer's transfer
take about as long as the compute of 4096 tokens (the balance point of the paper's 5090).

The executor's host-side tensor work (index_select, the zero "results", the merge) still runs on
this CPU, where a GPU would do it on the device, in series with the modelled compute; the link and
compute are slowed (0.25 GB/s, 0.125 TFLOP/s) so that the modelled times dominate it, and the same
step with an unthrottled link and free compute is reported as "host ms" for scale. With L layers
the pipeline cannot hide the first layer's load nor the last layer's compute: the best a double
buffer can do is about one layer's load + max(pool, compute) + one layer's compute.
Reported: wall ms, the two bounds (the pool at B_P; the modelled compute), wall / max(bounds), and
how much slower one buffer (on-demand loading) is than two.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from moed.cache.bank_builder import build_expert_bank
from moed.cache.host_bank import ExpertActivation
from moed.devices.emulated import EmulatedDevice
from moed.experts.bandwidth_model import BandwidthModel
from moed.experts.hybrid_executor import HybridExecutor
from moed.experts.policies import make_policy


def make_bank(layers: int, experts: int, hidden: int, inter: int):
    n = layers * experts
    gen = torch.Generator().manual_seed(0)
    return build_expert_bank(torch.randn(n, hidden, 2 * inter, generator=gen) * 0.02,
                             torch.randn(n, inter, hidden, generator=gen) * 0.02, num_moe_layers=layers,
                             num_experts=experts, dtype="bf16", activation=ExpertActivation())


def prefill_once(bank, buffers: int, tokens: int, top_k: int, b_p: float, flops: float) -> dict:
    device = EmulatedDevice(b_p=b_p, b_dev=1e18, flops_dev=flops, sleep_compute=True, timing_only=True)
    executor = HybridExecutor(bank, device, num_slots=2 * bank.num_experts, policy=make_policy("adaptive"),
                              bandwidth=BandwidthModel(min(b_p, 1e12), 20e9), prefill_buffers=buffers)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, bank.hidden_size, generator=gen)
    routing = []
    for _ in range(bank.num_moe_layers):
        w, ids = torch.topk(torch.rand(tokens, bank.num_experts, generator=gen), top_k, dim=-1)
        routing.append((ids, w / w.sum(-1, keepdim=True)))
    try:
        device.synchronize()
        before = device.stats()
        started = time.perf_counter()
        executor.begin_step("prefill", [0] * tokens, list(range(tokens)))
        for layer, (ids, w) in enumerate(routing):
            executor.run(layer, x, ids, w)
        wall = time.perf_counter() - started
        after = device.stats()
        assert executor.stats.streamed_layers == bank.num_moe_layers
        return dict(wall=wall, copied=after.bytes_copied - before.bytes_copied,
                    compute=after.compute_seconds - before.compute_seconds)
    finally:
        executor.close()
        device.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--bp", type=float, default=0.25, help="emulated link, GB/s")
    ap.add_argument("--tflops", type=float, default=0.125, help="emulated device compute, TFLOP/s")
    ap.add_argument("--tokens", default="1024,4096,8192")
    ap.add_argument("--repeats", type=int, default=2, help="best of")
    args = ap.parse_args(argv)
    bank = make_bank(args.layers, args.experts, args.hidden, args.inter)
    b_p, flops = args.bp * 1e9, args.tflops * 1e12
    pool = bank.nbytes()
    print(f"{args.layers} layers x {args.experts} experts ({args.hidden} x {args.inter}, bf16), top-{args.top_k}; "
          f"pool {pool / 1e6:.0f} MB; emulated B_P {args.bp} GB/s, compute {args.tflops} TFLOP/s; best of {args.repeats}\n")
    print("| tokens | buffers | wall ms | pool at B_P ms | modelled compute ms | wall / max(bounds) | host ms | "
          "one buffer vs two |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    best = lambda runs: min(runs, key=lambda r: r["wall"])  # noqa: E731
    for tokens in (int(t) for t in args.tokens.split(",")):
        rows = {}
        for buffers in (2, 1):
            timed = best([prefill_once(bank, buffers, tokens, args.top_k, b_p, flops) for _ in range(args.repeats)])
            host = best([prefill_once(bank, buffers, tokens, args.top_k, math.inf, 1e30) for _ in range(args.repeats)])
            rows[buffers] = dict(timed, host=host["wall"])
        for buffers in (2, 1):
            r = rows[buffers]
            transfer = r["copied"] / b_p
            bound = max(transfer, r["compute"])
            slower = f"{rows[1]['wall'] / rows[2]['wall'] - 1:+.0%}" if buffers == 1 else ""
            print(f"| {tokens} | {buffers} | {r['wall'] * 1e3:.0f} | {transfer * 1e3:.0f} | {r['compute'] * 1e3:.0f} | "
                  f"{r['wall'] / bound:.2f} | {r['host'] * 1e3:.0f} | {slower} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
