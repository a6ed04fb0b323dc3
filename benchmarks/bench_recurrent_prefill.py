#!/usr/bin/env python3
"""Recurrent layers' prefill: the chunked form vs the token-by-token one (issue #36): Mamba-2 and Kimi Delta Attention.

    python benchmarks/bench_recurrent_prefill.py --layer mamba2|kda [--tokens 4096] [--reference-tokens 512] [--fp32]
        [--device cpu|cuda] [--json OUT]

One layer at its model's shape, random weights, its projections bf16 as the checkpoints ship them (``--fp32`` for
float32): ``mamba2`` at Nemotron-3-Nano-30B-A3B's (hidden 2688, 64 heads of 64, 8 groups, state 128, conv kernel
4), ``kda`` at Kimi-Linear-48B-A3B's (hidden 2304, 32 heads of 128, conv kernel 4). It prefills ``--tokens``
tokens in one call, with the chunked form (``chunked_ssd`` / ``chunked_kda``). Against it, the same layer code token by token, two ways, each run on ``--reference-tokens``
and scaled to the same length (both are linear in the tokens): the layer called once per token (what decoding
the prompt would do: every projection a matrix-vector product), and one call whose rule is the token-by-token
recurrence (``recurrent_ssd`` / ``recurrent_kda``, the decode path and the reference: the projections stay
whole-prompt GEMMs). The
outputs are compared. The rule alone (without the projections, conv and norm) is timed the same way. No peer:
llama.cpp's kernels for these layers are a different program. ``--device cuda`` runs the same torch code on the GPU
(benchmarks/gpu_check.sh does, for issue #36's ratio where a device is lent: a per-token loop there pays its
kernel launches per token).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moed.layers import kda as kd
from moed.layers import mamba2 as m2


def kda_layer(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> kd.KimiDeltaAttention:
    cfg = kd.KdaConfig(num_heads=32, head_dim=128, conv_kernel=4)
    g = torch.Generator().manual_seed(seed)
    d, p = 2304, cfg.proj_dim
    w = {f"k.{n}.weight": torch.randn(rows, cols, generator=g) * cols ** -0.5
         for n, rows, cols in (("q_proj", p, d), ("k_proj", p, d), ("v_proj", p, d), ("f_a_proj", 128, d),
                               ("f_b_proj", p, 128), ("b_proj", 32, d), ("g_a_proj", 128, d), ("g_b_proj", p, 128),
                               ("o_proj", d, p))}
    for name in list(w):
        if not name.startswith(("k.f_", "k.b_", "k.g_")):
            w[name] = w[name].to(dtype)
    w.update({f"k.{n}_conv1d.weight": torch.randn(p, 1, 4, generator=g) * 0.5 for n in "qkv"})
    # A in [1, 16] (Kimi-Linear's init range), dt_bias around softplus^-1 of a small step
    w.update({"k.A_log": torch.rand(1, 1, 32, 1, generator=g) * 2.77, "k.dt_bias": torch.randn(p, generator=g) - 3.0,
              "k.o_norm.weight": torch.ones(128)})
    return kd.KimiDeltaAttention(cfg, {k: v.to(device) for k, v in w.items()}, "k")


def mamba2_layer(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> m2.Mamba2Mixer:
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
    return m2.Mamba2Mixer(cfg, {k: v.to(device) for k, v in w.items()}, "m")


def clock(device: torch.device) -> float:
    """Seconds, after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def run(net, module, x: torch.Tensor, chunked: bool) -> tuple[torch.Tensor, float]:
    shapes = net.state_shapes()
    conv = torch.zeros(1, *shapes["conv"], device=x.device)
    state = torch.zeros(1, *shapes["recurrent"], device=x.device)
    saved = module.CHUNKED_FROM
    module.CHUNKED_FROM = 1 if chunked else 1 << 30
    try:
        start = clock(x.device)
        out = net.forward(x, [x.shape[1]], conv, state)
        return out, clock(x.device) - start
    finally:
        module.CHUNKED_FROM = saved


def rule_inputs(layer: str, net, t: int, device: torch.device):
    """Random inputs of the rule alone at the layer's shape, and its (chunked, recurrent) functions."""
    gen = torch.Generator().manual_seed(1)
    c = net.cfg

    def on(*tensors):
        return tuple(a.to(device) for a in tensors)

    if layer == "mamba2":
        xs = torch.randn(t, c.num_heads, c.head_dim, generator=gen)
        dt = torch.nn.functional.softplus(torch.randn(t, c.num_heads, generator=gen) - 2.0)
        b = torch.randn(t, c.num_groups, c.state_size, generator=gen)
        cc = torch.randn(t, c.num_groups, c.state_size, generator=gen)
        state = torch.zeros(c.num_heads, c.head_dim, c.state_size, device=device)
        return on(xs, dt, net.a, b, cc), state, m2.chunked_ssd, m2.recurrent_ssd
    h, dk = c.num_heads, c.head_dim
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v, beta = torch.randn(t, h, dk, generator=gen), torch.rand(t, h, generator=gen)
    g = -torch.rand(t, h, dk, generator=gen) * 0.5
    return on(q, k, v, beta, g), torch.zeros(h, dk, dk, device=device), kd.chunked_kda, kd.recurrent_kda


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", choices=("mamba2", "kda"), default="mamba2")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reference-tokens", type=int, default=512)
    ap.add_argument("--fp32", action="store_true", help="float32 projections (default: bf16, as shipped)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: the same torch code on the GPU")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    device = torch.device(args.device)
    net, module = (mamba2_layer(dtype=dtype, device=args.device), m2) if args.layer == "mamba2" \
        else (kda_layer(dtype=dtype, device=args.device), kd)
    x = (torch.randn(1, args.tokens, net.w_out.shape[0]) * 0.5).to(device)
    run(net, module, x[:, :256], True)  # warm up both paths
    run(net, module, x[:, :16], False)
    ref_out, ref_s = run(net, module, x[:, : args.reference_tokens], False)
    chk_out, _ = run(net, module, x[:, : args.reference_tokens], True)
    diff = float((ref_out - chk_out).abs().max() / ref_out.abs().max())
    # the layer once per token (decode steps), on the same reference tokens
    shapes = net.state_shapes()
    conv = torch.zeros(1, *shapes["conv"], device=device)
    state = torch.zeros(1, *shapes["recurrent"], device=device)
    start = clock(device)
    steps = [net.forward(x[:, i:i + 1], [1], conv, state) for i in range(args.reference_tokens)]
    per_token_s = (clock(device) - start) * args.tokens / args.reference_tokens
    diff = max(diff, float((torch.cat(steps, dim=1) - chk_out).abs().max() / ref_out.abs().max()))
    _, chunked_s = run(net, module, x, True)
    recurrent_s = ref_s * args.tokens / args.reference_tokens
    # the rule alone, at the layer's shape
    t, n = args.tokens, args.reference_tokens
    inputs, state, chunked_rule, recurrent_rule = rule_inputs(args.layer, net, t, device)
    start = clock(device)
    chunked_rule(*inputs, state.clone())
    scan_chunked = clock(device) - start
    start = clock(device)
    recurrent_rule(*(a if a.dim() == 1 else a[:n] for a in inputs), state.clone())
    scan_recurrent = (clock(device) - start) * t / n
    result = {"layer": args.layer, "tokens": t, "reference_tokens": n, "threads": torch.get_num_threads(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
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
