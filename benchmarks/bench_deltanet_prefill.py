#!/usr/bin/env python3
"""Gated DeltaNet prefill: the chunk-parallel delta rule vs the token-by-token one (issue #30, deliver 4).

    python benchmarks/bench_deltanet_prefill.py [--tokens 8192] [--reference-tokens 1024] [--json OUT]

One linear-attention layer at Qwen3-Next-80B-A3B's shape (hidden 2048, 16 key heads and 32 value heads
of 128, conv kernel 4; random weights, float32) prefills ``--tokens`` tokens with the chunked rule; the
token-by-token rule (today's decode path, the previous prefill path) runs ``--reference-tokens`` and is
scaled to the same length (its cost is linear in the tokens). Both rules' outputs on the reference
tokens are compared. The delta rule alone is timed the same way. No peer: llama.cpp's Qwen3-Next
kernels are a different program; the whole-model comparison is bench_long_context's job (not built).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moed.layers import gated_deltanet as gd


def layer(seed: int = 0) -> gd.GatedDeltaNet:
    cfg = gd.DeltaNetConfig(num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128, conv_kernel=4)
    g = torch.Generator().manual_seed(seed)
    d, c = 2048, cfg
    qkvz = 2 * c.key_dim + 2 * c.value_dim
    w = {"la.in_proj_qkvz.weight": torch.randn(qkvz, d, generator=g) * d ** -0.5,
         "la.in_proj_ba.weight": torch.randn(2 * c.num_v_heads, d, generator=g) * d ** -0.5,
         "la.conv1d.weight": torch.randn(c.conv_dim, 1, c.conv_kernel, generator=g) * 0.5,
         "la.dt_bias": torch.randn(c.num_v_heads, generator=g) * 0.5,
         "la.A_log": torch.randn(c.num_v_heads, generator=g) * 0.5,
         "la.norm.weight": torch.ones(c.v_head_dim),
         "la.out_proj.weight": torch.randn(d, c.value_dim, generator=g) * c.value_dim ** -0.5}
    return gd.GatedDeltaNet(cfg, w, "la")


def run(net: gd.GatedDeltaNet, x: torch.Tensor, chunked: bool) -> tuple[torch.Tensor, float]:
    shapes = net.state_shapes()
    conv, state = torch.zeros(1, *shapes["conv"]), torch.zeros(1, *shapes["recurrent"])
    saved = gd.CHUNKED_FROM
    gd.CHUNKED_FROM = 1 if chunked else 1 << 30
    try:
        start = time.perf_counter()
        out = net.forward(x, [x.shape[1]], conv, state)
        return out, time.perf_counter() - start
    finally:
        gd.CHUNKED_FROM = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reference-tokens", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    net = layer()
    x = torch.randn(1, args.tokens, 2048) * 0.5
    run(net, x[:, :256], True)  # warm up both paths
    run(net, x[:, :32], False)
    ref_out, ref_s = run(net, x[:, : args.reference_tokens], False)
    chk_out, _ = run(net, x[:, : args.reference_tokens], True)
    diff = float((ref_out - chk_out).abs().max() / ref_out.abs().max())
    _, chunked_s = run(net, x, True)
    recurrent_s = ref_s * args.tokens / args.reference_tokens
    # the delta rule alone, at the layer's head shape (q/k L2-normalised, as the layer feeds it)
    t, h, dk = args.tokens, net.cfg.num_v_heads, net.cfg.k_head_dim
    q = torch.nn.functional.normalize(torch.randn(t, h, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk), dim=-1)
    v, beta, g = torch.randn(t, h, net.cfg.v_head_dim), torch.rand(t, h), -torch.rand(t, h)
    state = torch.zeros(h, dk, net.cfg.v_head_dim)
    start = time.perf_counter()
    gd.chunked_delta_rule(q, k, v, beta, g, state.clone())
    rule_chunked = time.perf_counter() - start
    n = args.reference_tokens
    start = time.perf_counter()
    gd.recurrent_delta_rule(q[:n], k[:n], v[:n], beta[:n], g[:n], state.clone())
    rule_recurrent = (time.perf_counter() - start) * t / n
    result = {"rule_chunked_s": round(rule_chunked, 2), "rule_token_by_token_s": round(rule_recurrent, 2),
              "rule_speedup": round(rule_recurrent / rule_chunked, 1), "tokens": args.tokens, "threads": torch.get_num_threads(), "chunked_s": round(chunked_s, 2),
              "chunked_tok_s": round(args.tokens / chunked_s, 1),
              "token_by_token_s": round(recurrent_s, 2), "token_by_token_tok_s": round(args.tokens / recurrent_s, 1),
              "layer_speedup": round(recurrent_s / chunked_s, 1), "max_rel_diff": diff, "chunk": gd.CHUNK}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
