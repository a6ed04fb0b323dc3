#!/usr/bin/env python3
"""Mamba-2 prefill: the chunked state-space form vs the token-by-token recurrence (issue #36).

    python benchmarks/bench_mamba2_prefill.py [--tokens 4096] [--reference-tokens 512] [--fp32] [--json OUT]

One Mamba-2 layer at Nemotron-3-Nano-30B-A3B's shape (hidden 2688, 64 heads of 64, 8 groups, state 128, conv
kernel 4; random weights, its in/out projections bf16 as the checkpoint ships them, ``--fp32`` for float32) prefills ``--tokens`` tokens in one call, with the chunked form (``chunked_ssd``,
128-token chunks). Against it, the same layer code token by token, two ways, each run on ``--reference-tokens``
and scaled to the same length (both are linear in the tokens): the layer called once per token (what decoding
the prompt would do: every projection a matrix-vector product), and one call whose scan is the token-by-token
recurrence (``recurrent_ssd``, the decode path and the reference: the projections stay whole-prompt GEMMs). The
outputs are compared. The scan alone (without the projections, conv and norm) is timed the same way. No peer:
llama.cpp's Mamba-2 kernels are a different program.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moed.layers import mamba2 as m2


def layer(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> m2.Mamba2Mixer:
    cfg = m2.Mamba2Config(num_heads=64, head_dim=64, num_groups=8, state_size=128, conv_kernel=4)
    g = torch.Generator().manual_seed(seed)
    d = 2688
    w = {"m.in_proj.weight": torch.randn(cfg.projection_dim, d, generator=g) * d ** -0.5,
         "m.conv1d.weight": torch.randn(cfg.conv_dim, 1, cfg.conv_kernel, generator=g) * 0.5,
         "m.conv1d.bias": torch.randn(cfg.conv_dim, generator=g) * 0.1,
         "m.dt_bias": torch.randn(cfg.num_heads, generator=g) * 0.5 - 2.0,
         "m.A_log": torch.rand(cfg.num_heads, generator=g) * 2.7,  # A in [-15, -1]: Nemotron's init range
         "m.D": torch.ones(cfg.num_heads), "m.norm.weight": torch.ones(cfg.inner_dim),
         "m.out_proj.weight": torch.randn(d, cfg.inner_dim, generator=g) * cfg.inner_dim ** -0.5}
    for name in ("m.in_proj.weight", "m.out_proj.weight"):
        w[name] = w[name].to(dtype)
    return m2.Mamba2Mixer(cfg, w, "m")


def run(net: m2.Mamba2Mixer, x: torch.Tensor, chunked: bool) -> tuple[torch.Tensor, float]:
    shapes = net.state_shapes()
    conv, state = torch.zeros(1, *shapes["conv"]), torch.zeros(1, *shapes["recurrent"])
    saved = m2.CHUNKED_FROM
    m2.CHUNKED_FROM = 1 if chunked else 1 << 30
    try:
        start = time.perf_counter()
        out = net.forward(x, [x.shape[1]], conv, state)
        return out, time.perf_counter() - start
    finally:
        m2.CHUNKED_FROM = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reference-tokens", type=int, default=512)
    ap.add_argument("--fp32", action="store_true", help="float32 projections (default: bf16, as shipped)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    net = layer(dtype=torch.float32 if args.fp32 else torch.bfloat16)
    x = torch.randn(1, args.tokens, 2688) * 0.5
    run(net, x[:, :256], True)  # warm up both paths
    run(net, x[:, :16], False)
    ref_out, ref_s = run(net, x[:, : args.reference_tokens], False)
    chk_out, _ = run(net, x[:, : args.reference_tokens], True)
    diff = float((ref_out - chk_out).abs().max() / ref_out.abs().max())
    # the layer once per token (decode steps), on the same reference tokens
    shapes = net.state_shapes()
    conv, state = torch.zeros(1, *shapes["conv"]), torch.zeros(1, *shapes["recurrent"])
    start = time.perf_counter()
    steps = [net.forward(x[:, i:i + 1], [1], conv, state) for i in range(args.reference_tokens)]
    per_token_s = (time.perf_counter() - start) * args.tokens / args.reference_tokens
    diff = max(diff, float((torch.cat(steps, dim=1) - chk_out).abs().max() / ref_out.abs().max()))
    _, chunked_s = run(net, x, True)
    recurrent_s = ref_s * args.tokens / args.reference_tokens
    # the scan alone, at the layer's shape
    c, t, n = net.cfg, args.tokens, args.reference_tokens
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(t, c.num_heads, c.head_dim, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(t, c.num_heads, generator=gen) - 2.0)
    b = torch.randn(t, c.num_groups, c.state_size, generator=gen)
    cc = torch.randn(t, c.num_groups, c.state_size, generator=gen)
    state = torch.zeros(c.num_heads, c.head_dim, c.state_size)
    start = time.perf_counter()
    m2.chunked_ssd(xs, dt, net.a, b, cc, state.clone())
    scan_chunked = time.perf_counter() - start
    start = time.perf_counter()
    m2.recurrent_ssd(xs[:n], dt[:n], net.a, b[:n], cc[:n], state.clone())
    scan_recurrent = (time.perf_counter() - start) * t / n
    result = {"tokens": t, "reference_tokens": n, "threads": torch.get_num_threads(),
              "projections": "fp32" if args.fp32 else "bf16",
              "layer_chunked_s": round(chunked_s, 3), "layer_recurrent_s": round(recurrent_s, 3),
              "layer_ratio": round(recurrent_s / chunked_s, 1), "layer_per_token_s": round(per_token_s, 3),
              "per_token_ratio": round(per_token_s / chunked_s, 1), "scan_chunked_s": round(scan_chunked, 3),
              "scan_recurrent_s": round(scan_recurrent, 3), "scan_ratio": round(scan_recurrent / scan_chunked, 1),
              "max_rel_diff": diff}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
